//! The gRPC client of `berth serve`: a connection (TLS and mutual TLS, a
//! bearer token on every call) and the calls that take more than one
//! request. The CLI, the benchmarks, the simulation test and the
//! integration tests all connect through it.

use std::path::Path;

use anyhow::Context;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use crate::proto::{self as pb, berth_client::BerthClient};

/// Bytes of a server's error message printed.
const PRINT_BYTES: usize = 1024;

/// Adds the bearer token to every call.
#[derive(Clone)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

pub type Client = BerthClient<InterceptedService<Channel, Bearer>>;

impl Bearer {
    /// The interceptor for `token` (none: calls go without one).
    pub fn new(token: Option<&str>) -> anyhow::Result<Bearer> {
        Ok(Bearer(match token {
            Some(t) => Some(format!("Bearer {t}").parse().context("token is not valid header text")?),
            None => None,
        }))
    }
}

/// A connected channel to `server`: TLS when `ca` is given (and the client
/// identity for mTLS). The API client and the agent's hub client share it.
pub async fn channel(server: &str, ca: Option<&Path>, identity: Option<(&Path, &Path)>) -> anyhow::Result<Channel> {
    let mut endpoint = Channel::from_shared(server.to_string()).with_context(|| format!("server URL {server:?}"))?;
    if ca.is_some() || identity.is_some() {
        let mut tls = ClientTlsConfig::new();
        if let Some(ca) = ca {
            tls = tls.ca_certificate(Certificate::from_pem(std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?));
        }
        if let Some((cert, key)) = identity {
            tls = tls.identity(Identity::from_pem(std::fs::read(cert)?, std::fs::read(key)?));
        }
        endpoint = endpoint.tls_config(tls)?;
    }
    endpoint.connect().await.with_context(|| format!("connecting to {server}"))
}

/// Connects to a server: TLS when `ca` is given (and the client identity
/// for mTLS), a bearer token when given.
pub async fn connect(server: &str, token: Option<&str>, ca: Option<&Path>, identity: Option<(&Path, &Path)>) -> anyhow::Result<Client> {
    let channel = channel(server, ca, identity).await?;
    // Replies are cut to 3 MiB by the server; a larger receive limit keeps
    // an older or differently configured server's reply readable.
    Ok(BerthClient::with_interceptor(channel, Bearer::new(token)?).max_encoding_message_size(64 << 20).max_decoding_message_size(64 << 20))
}

/// Every job `req` selects, read page by page (a page is at most 10,000
/// jobs and 4 MiB).
pub async fn list_all_jobs(mut api: Client, mut req: pb::ListJobsRequest) -> anyhow::Result<Vec<pb::Job>> {
    let mut all = Vec::new();
    loop {
        let page = api.list_jobs(req.clone()).await.map_err(status)?.into_inner();
        all.extend(page.jobs);
        if page.next_before_id == 0 {
            return Ok(all);
        }
        req.before_id = page.next_before_id;
    }
}

/// A server's answer other than OK, as an error that names its code (and
/// keeps it: the CLI's exit status tells a refusal from an outage).
#[derive(Debug, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct Answered {
    pub code: tonic::Code,
    message: String,
}

/// Turns a gRPC status into an error that names its code.
pub fn status(s: tonic::Status) -> anyhow::Error {
    Answered { code: s.code(), message: crate::text::printable(s.message(), PRINT_BYTES).into_owned() }.into()
}

/// The exit statuses of `berth` commands (listed in `berth --help`).
pub mod exit {
    /// Anything else that failed (a file, a policy, a local check, the
    /// server's own failure: INTERNAL, UNKNOWN, DATA_LOSS).
    pub const FAILED: u8 = 1;
    /// The command line was wrong (clap's own status).
    pub const USAGE: u8 = 2;
    /// The server answered and refused (invalid, not found, not allowed,
    /// not in this state).
    pub const REFUSED: u8 = 3;
    /// The server could not be reached, or could not serve now (retry).
    pub const UNREACHABLE: u8 = 4;
}

/// The exit status for a command that failed with `e`; `None` when the
/// reader of its output went away (a closed pipe: `berth jobs | head`),
/// which is no failure of the command's.
pub fn exit_code(e: &anyhow::Error) -> Option<u8> {
    let mut code = exit::FAILED;
    for cause in e.chain() {
        if cause.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe) {
            return None;
        }
        let answered = cause.downcast_ref::<Answered>().map(|a| a.code).or_else(|| cause.downcast_ref::<tonic::Status>().map(|s| s.code()));
        if let Some(c) = answered {
            code = match c {
                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded => exit::UNREACHABLE,
                // The server failed, not the request.
                tonic::Code::Internal | tonic::Code::Unknown | tonic::Code::DataLoss => exit::FAILED,
                _ => exit::REFUSED,
            };
            break;
        }
        if cause.downcast_ref::<tonic::transport::Error>().is_some() {
            code = exit::UNREACHABLE;
            break;
        }
    }
    Some(code)
}
