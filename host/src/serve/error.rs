//! The one error type of the live host: what an API call or a policy
//! operation can fail with, and the gRPC status each maps onto.

/// Everything an API call or a policy operation can fail with. Each maps
/// onto one gRPC status code, with the message as the status message.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    PermissionDenied(String),
    // Bounded and escaped: the name is the caller's.
    #[error("unknown partition \"{}\"", crate::text::printable(.0, 64))]
    UnknownPartition(String),
    #[error("no job {0}")]
    UnknownJob(u64),
    #[error("partition {partition} has no policy version {version}")]
    UnknownVersion { partition: String, version: u32 },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("component rejected: {0}")]
    Rejected(String),
    #[error("component is {size} bytes; the upload limit is {limit}")]
    TooLarge { size: usize, limit: usize },
    #[error("{0}")]
    FailedPrecondition(String),
    /// This host does not lead (HA on etcd): another one owns the state.
    #[error("{0}")]
    Unavailable(String),
    #[error("state directory: {0}")]
    Store(#[from] std::io::Error),
}

impl From<ServeError> for tonic::Status {
    fn from(e: ServeError) -> tonic::Status {
        use tonic::Code;
        let code = match &e {
            ServeError::Unauthenticated(_) => Code::Unauthenticated,
            ServeError::PermissionDenied(_) => Code::PermissionDenied,
            ServeError::UnknownPartition(_) | ServeError::UnknownJob(_) | ServeError::UnknownVersion { .. } => Code::NotFound,
            ServeError::Invalid(_) | ServeError::Rejected(_) => Code::InvalidArgument,
            ServeError::TooLarge { .. } => Code::ResourceExhausted,
            ServeError::FailedPrecondition(_) => Code::FailedPrecondition,
            ServeError::Unavailable(_) => Code::Unavailable,
            ServeError::Store(_) => Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}

