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

/// Turns a gRPC status into an error that names its code.
pub fn status(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), crate::text::printable(s.message(), PRINT_BYTES))
}
