//! `berth agent`: one per node. Discovers the node's GPUs (NVML, or a
//! synthetic shape for tests and demos), registers them with `berth serve`,
//! sends heartbeats with telemetry, and runs allocations as child processes
//! that see exactly their GPUs (`CUDA_VISIBLE_DEVICES` and
//! `NVIDIA_VISIBLE_DEVICES` set to the assigned UUIDs).
//!
//! Each task runs under a supervisor (this binary, `berth agent
//! --supervise`) in its own process group, recorded in the agent's state
//! directory: an agent killed and restarted adopts the tasks still running
//! and reports how the others ended. Exit reports the host has not
//! acknowledged are kept and resent (to the next host, in HA).
//!
//! The host side ([`hub`]) records agents, marks a GPU unhealthy on an XID
//! or ECC event, marks a node unreachable after missed heartbeats (and
//! requeues its jobs after a grace, fencing its GPUs until it returns),
//! reconciles what a returning node runs (adopts, or stops orphans), and
//! sends start/stop/sleep/wake/checkpoint commands down a server stream.

pub mod devices;
pub mod run;

use std::path::Path;

use anyhow::Context;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

use crate::proto::agent_hub_client::AgentHubClient;

/// Adds the bearer token to every call.
#[derive(Clone)]
pub struct Token(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Token {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

pub type HubClient = AgentHubClient<InterceptedService<Channel, Token>>;

/// Connects to the agent service of a `berth serve` (TLS when `ca` is given).
pub async fn connect_hub(server: &str, token: Option<&str>, ca: Option<&Path>) -> anyhow::Result<HubClient> {
    let mut endpoint = Channel::from_shared(server.to_string()).with_context(|| format!("server URL {server:?}"))?;
    if let Some(ca) = ca {
        let pem = std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?;
        endpoint = endpoint.tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)))?;
    }
    let channel = endpoint.connect().await.with_context(|| format!("connecting to {server}"))?;
    let token = match token {
        Some(t) => Some(format!("Bearer {t}").parse().context("token is not valid header text")?),
        None => None,
    };
    Ok(AgentHubClient::with_interceptor(channel, Token(token)))
}
