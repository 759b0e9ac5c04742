//! Generates the gRPC code of `berth serve` from host/proto with a vendored
//! protoc, so building needs nothing installed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded here.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=proto");
    // Our codec: an undecodable request is INVALID_ARGUMENT, not INTERNAL.
    // Serialize: the web console answers in JSON with the API's own messages.
    tonic_prost_build::configure()
        .codec_path("crate::serve::codec::Codec")
        .type_attribute(".berth.v1", "#[derive(serde::Serialize)]")
        .compile_protos(&["proto/berth/v1/berth.proto", "proto/berth/v1/agent.proto"], &["proto"])?;
    // The etcd store's client (a subset of etcd's v3 API).
    tonic_prost_build::configure().build_server(false).compile_protos(&["proto/etcd/rpc.proto"], &["proto"])?;
    Ok(())
}
