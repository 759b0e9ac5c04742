//! The generated protobuf types and gRPC stubs of `berth.v1` (the API and
//! the agent protocol), shared by the host (`serve`) and the node agent
//! (`agent`) so that neither imports the other.

tonic::include_proto!("berth.v1");
