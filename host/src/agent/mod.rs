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
//! Each task runs confined to what it asked for ([`isolation`]): its own
//! cgroup with a CPU quota, a memory limit and the node's CPU list (or CPU
//! affinity alone where there are no cgroups); heartbeats carry the node's
//! pressure and each task's use.
//!
//! The host side ([`hub`]) records agents, marks a GPU unhealthy on an XID
//! or ECC event, marks a node unreachable after missed heartbeats (and
//! requeues its jobs after a grace, fencing its GPUs until it returns),
//! reconciles what a returning node runs (adopts, or stops orphans), and
//! sends start/stop/sleep/wake/checkpoint commands down a server stream.

pub mod devices;
pub mod isolation;
pub mod run;

use std::path::Path;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::proto::agent_hub_client::AgentHubClient;

pub type HubClient = AgentHubClient<InterceptedService<Channel, crate::client::Bearer>>;

/// Connects to the agent service of a `berth serve` (TLS when `ca` is given).
pub async fn connect_hub(server: &str, token: Option<&str>, ca: Option<&Path>) -> anyhow::Result<HubClient> {
    let channel = crate::client::channel(server, ca, None).await?;
    Ok(AgentHubClient::with_interceptor(channel, crate::client::Bearer::new(token)?))
}
