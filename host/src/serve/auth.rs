//! Access control. Uploading a policy is running code on the scheduler, so
//! nothing is open by default: every call must present a bearer token or an
//! mTLS client certificate named in the access file, and each identity holds
//! a role per partition.
//!
//! ```toml
//! # Optional: uploads must match one of these SHA-256 digests.
//! allowed_components = ["9f2c..."]
//! # Optional: the highest job priority a tenant may set, per partition
//! # ("*" = every other partition; 100 where none is set). Operators are
//! # not capped.
//! tenant_max_priority = { "*" = 100, "batch" = 10 }
//! # Optional: the tiers a tenant may buy per partition, and the tier of a
//! # job that names none (every tier and "preemptible" where none is set).
//! # Operators may buy any tier.
//! tenant_tiers = { "*" = ["preemptible", "opportunistic"], "prod" = ["guaranteed", "preemptible"] }
//! default_tier = { "*" = "preemptible", "scavenge" = "opportunistic" }
//!
//! [[identities]]
//! name = "ops"
//! token = "ops-secret"             # or token_sha256 = "<hex>"
//! cert_sha256 = "<hex of DER>"      # optional: mTLS client certificate
//! roles = { "*" = "operator" }     # "*" = every partition
//!
//! [[identities]]
//! name = "rack-7-agents"
//! token = "agent-secret"           # read by `berth agent --token-file`
//! roles = { "gpu" = "agent" }      # register, heartbeat, report: nothing else
//! nodes = ["rack7-*"]              # the node names it may act as
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::error::ServeError;
use berth_core::Tier;

/// What an identity may do in a partition; each role includes the ones
/// before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A node agent: registers, heartbeats, takes commands and reports
    /// allocations for the nodes its identity names (`nodes`), and nothing
    /// else (not even reading jobs).
    Agent,
    /// Read jobs, nodes, accounting, decisions and policy history.
    Viewer,
    /// Also submit jobs, and cancel its own.
    Tenant,
    /// Also manage policies and cancel anyone's jobs.
    Operator,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct IdentityConfig {
    name: String,
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    token_sha256: Option<String>,
    #[serde(default)]
    cert_sha256: Option<String>,
    roles: BTreeMap<String, Role>,
    /// Node names an agent identity may act as (`*` at the end: a prefix).
    #[serde(default)]
    nodes: Option<Vec<String>>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AccessConfig {
    #[serde(default)]
    allowed_components: Option<Vec<String>>,
    #[serde(default)]
    tenant_max_priority: BTreeMap<String, u32>,
    #[serde(default)]
    tenant_tiers: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    default_tier: BTreeMap<String, String>,
    identities: Vec<IdentityConfig>,
}

/// A caller the server recognised.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub name: String,
    roles: BTreeMap<String, Role>,
    /// Node-name patterns for the agent role (exact, or a prefix ending in `*`).
    nodes: Vec<String>,
}

/// Most node patterns an identity may list.
const MAX_NODE_PATTERNS: usize = 100_000;

impl Identity {
    /// The role in `partition`: the partition's own entry, else `*`.
    pub fn role_in(&self, partition: &str) -> Option<Role> {
        self.roles.get(partition).or_else(|| self.roles.get("*")).copied()
    }

    /// Whether it may read `partition` (viewer or above; an agent may not).
    pub fn can_view(&self, partition: &str) -> bool {
        self.role_in(partition) >= Some(Role::Viewer)
    }

    /// Whether it holds the operator role in some partition.
    pub fn is_operator_somewhere(&self) -> bool {
        self.roles.values().any(|&r| r == Role::Operator)
    }

    /// Whether one of its node patterns names `node`.
    fn names_node(&self, node: &str) -> bool {
        self.nodes.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => node.starts_with(prefix),
            None => p == node,
        })
    }

    /// Whether it could act as agent node `node` in some partition: an
    /// operator anywhere, or an agent whose patterns name the node. Asked
    /// before any lookup, so the answer says nothing of what exists.
    pub fn could_act_as_node(&self, node: &str) -> bool {
        self.is_operator_somewhere() || (self.roles.values().any(|&r| r == Role::Agent) && self.names_node(node))
    }

    /// Whether it may act as agent node `node` of `partition`: the
    /// partition's operator, or its agent naming that node.
    pub fn may_act_as_node(&self, partition: &str, node: &str) -> bool {
        match self.role_in(partition) {
            Some(Role::Operator) => true,
            Some(Role::Agent) => self.names_node(node),
            _ => false,
        }
    }

    /// Checks that the identity holds at least `role` in `partition`.
    pub fn require(&self, partition: &str, role: Role) -> Result<(), ServeError> {
        match self.role_in(partition) {
            Some(r) if r >= role => Ok(()),
            held => {
                let held = held.map_or("no role".to_string(), |r| format!("role {r:?}"));
                // The partition name is the caller's: bounded and escaped.
                let shown = crate::text::printable(partition, 64);
                let e = ServeError::PermissionDenied(format!("{} holds {held} in partition \"{shown}\"; this needs {role:?}", self.name));
                tracing::warn!(target: "berth::serve::auth", identity = %self.name, partition = %shown, "denied: {e}");
                Err(e)
            }
        }
    }
}

/// Longest node name, as a DNS name.
pub const MAX_NODE_NAME_BYTES: usize = 253;

/// A node name is 1 to 253 bytes of ASCII letters, digits, `.`, `-` and
/// `_`, starting with a letter or digit, without `..`: it is printed,
/// logged and used in store keys and paths, so nothing in it may act on a
/// terminal, a log line or a path. The error quotes the name bounded and
/// escaped.
pub fn check_node_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NODE_NAME_BYTES
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && !name.contains("..");
    if ok {
        Ok(())
    } else {
        Err(format!(
            "node name \"{}\" ({} bytes): 1 to {MAX_NODE_NAME_BYTES} bytes of letters, digits, '.', '-' and '_', starting with a letter or digit, without \"..\"",
            crate::text::printable(name, 64),
            name.len()
        ))
    }
}

/// The parsed access file.
#[derive(Clone, Debug)]
pub struct Access {
    /// (SHA-256 of the token, identity)
    tokens: Vec<(String, Identity)>,
    /// (SHA-256 of the certificate's DER, identity)
    certs: Vec<(String, Identity)>,
    allowed_components: Option<Vec<String>>,
    tenant_max_priority: BTreeMap<String, u32>,
    tenant_tiers: BTreeMap<String, Vec<Tier>>,
    default_tier: BTreeMap<String, Tier>,
}

/// A tier named in the access file, or an error naming where.
fn tier_named(name: &str, at: &str) -> anyhow::Result<Tier> {
    Tier::from_name(name).ok_or_else(|| anyhow::anyhow!("{at}: tier \"{}\" is not one of guaranteed, preemptible, opportunistic", crate::text::printable(name, 32)))
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

impl Access {
    pub fn load(path: &Path) -> anyhow::Result<Access> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading access file {}", path.display()))?;
        Access::parse(&text).with_context(|| format!("access file {}", path.display()))
    }

    pub fn parse(text: &str) -> anyhow::Result<Access> {
        let cfg: AccessConfig = crate::text::parse_toml(text)?;
        anyhow::ensure!(!cfg.identities.is_empty(), "no identities: the API would be closed to everyone");
        let mut tenant_tiers = BTreeMap::new();
        for (partition, names) in &cfg.tenant_tiers {
            let at = format!("tenant_tiers.{partition}");
            let tiers = names.iter().map(|n| tier_named(n, &at)).collect::<anyhow::Result<Vec<Tier>>>()?;
            tenant_tiers.insert(partition.clone(), tiers);
        }
        let mut default_tier = BTreeMap::new();
        for (partition, name) in &cfg.default_tier {
            let tier = tier_named(name, &format!("default_tier.{partition}"))?;
            // A default a tenant may not buy would refuse every job that names none.
            let may = tenant_tiers.get(partition).or_else(|| tenant_tiers.get("*"));
            anyhow::ensure!(
                may.is_none_or(|m: &Vec<Tier>| m.contains(&tier)),
                "default_tier.{partition}: {name} is not among the tiers tenants may buy there (tenant_tiers)"
            );
            default_tier.insert(partition.clone(), tier);
        }
        let mut access = Access {
            tokens: Vec::new(),
            certs: Vec::new(),
            allowed_components: None,
            tenant_max_priority: cfg.tenant_max_priority,
            tenant_tiers,
            default_tier,
        };
        for id in cfg.identities {
            anyhow::ensure!(!id.name.is_empty(), "an identity without a name");
            // Names are printed and logged (job owners, `by=`): bounded, and
            // nothing a terminal or a log reader would act on.
            anyhow::ensure!(
                crate::text::printable(&id.name, 256) == id.name.as_str(),
                "identity \"{}\": a name is at most 256 bytes, without control or formatting characters",
                crate::text::printable(&id.name, 64)
            );
            let nodes = id.nodes.unwrap_or_default();
            let agent = id.roles.values().any(|&r| r == Role::Agent);
            anyhow::ensure!(
                !agent || !nodes.is_empty(),
                "identity {}: an agent role needs `nodes`, the node names it may act as (a trailing * makes a prefix)",
                id.name
            );
            anyhow::ensure!(agent || nodes.is_empty(), "identity {}: `nodes` is only for identities with an agent role", id.name);
            anyhow::ensure!(nodes.len() <= MAX_NODE_PATTERNS, "identity {}: more than {MAX_NODE_PATTERNS} node patterns", id.name);
            for n in &nodes {
                let name = n.strip_suffix('*').unwrap_or(n);
                anyhow::ensure!(
                    (n.ends_with('*') && name.is_empty()) || check_node_name(name).is_ok(),
                    "identity {}: node pattern \"{}\" is not a node name (optionally ending in *)",
                    id.name,
                    crate::text::printable(n, 64)
                );
            }
            let identity = Identity { name: id.name.clone(), roles: id.roles, nodes };
            let token = match (id.token, id.token_sha256) {
                (Some(t), None) => {
                    anyhow::ensure!(t.len() >= 8, "identity {}: token shorter than 8 characters", id.name);
                    Some(sha256_hex(t.as_bytes()))
                }
                (None, Some(h)) => Some(h.to_lowercase()),
                (None, None) => None,
                (Some(_), Some(_)) => anyhow::bail!("identity {}: give token or token_sha256, not both", id.name),
            };
            anyhow::ensure!(token.is_some() || id.cert_sha256.is_some(), "identity {}: needs a token or a cert_sha256", id.name);
            if let Some(t) = token {
                anyhow::ensure!(!access.tokens.iter().any(|(h, _)| *h == t), "identity {}: token used twice", id.name);
                access.tokens.push((t, identity.clone()));
            }
            if let Some(c) = id.cert_sha256 {
                access.certs.push((c.to_lowercase(), identity));
            }
        }
        access.allowed_components = cfg.allowed_components.map(|v| v.into_iter().map(|h| h.to_lowercase()).collect());
        Ok(access)
    }

    /// Who is calling: the bearer token, else the client certificate.
    pub fn identify<T>(&self, request: &tonic::Request<T>) -> Result<Identity, ServeError> {
        if let Some(value) = request.metadata().get("authorization") {
            let value = value.to_str().map_err(|_| ServeError::Unauthenticated("authorization header is not text".into()))?;
            return self.identify_bearer(value);
        }
        if let Some(certs) = request.peer_certs()
            && let Some(leaf) = certs.first()
        {
            let digest = sha256_hex(leaf.as_ref());
            if let Some((_, id)) = self.certs.iter().find(|(h, _)| *h == digest) {
                return Ok(id.clone());
            }
            tracing::warn!(target: "berth::serve::auth", cert = %digest, "unknown client certificate refused");
            return Err(ServeError::Unauthenticated(format!("client certificate {digest} is not in the access file")));
        }
        tracing::warn!(target: "berth::serve::auth", "anonymous call refused");
        Err(ServeError::Unauthenticated("no credentials: send `authorization: Bearer <token>` or a client certificate".into()))
    }

    /// Who sends this `authorization` header value (`Bearer <token>`): the
    /// API's check, shared with the web console.
    pub fn identify_bearer(&self, value: &str) -> Result<Identity, ServeError> {
        let token = value
            .strip_prefix("Bearer ")
            .ok_or_else(|| ServeError::Unauthenticated("authorization header must be `Bearer <token>`".into()))?;
        let digest = sha256_hex(token.trim().as_bytes());
        match self.tokens.iter().find(|(h, _)| *h == digest) {
            Some((_, id)) => Ok(id.clone()),
            None => {
                tracing::warn!(target: "berth::serve::auth", "unknown bearer token refused");
                Err(ServeError::Unauthenticated("unknown bearer token".into()))
            }
        }
    }

    /// The highest priority a tenant may give a job in `partition`, if the
    /// access file sets one (the partition's own entry, else `*`).
    pub fn priority_ceiling(&self, partition: &str) -> Option<u32> {
        self.tenant_max_priority.get(partition).or_else(|| self.tenant_max_priority.get("*")).copied()
    }

    /// The tier of a job in `partition` that names none.
    pub fn default_tier(&self, partition: &str) -> Tier {
        self.default_tier.get(partition).or_else(|| self.default_tier.get("*")).copied().unwrap_or_default()
    }

    /// The tiers a tenant may buy in `partition` (every tier where the
    /// access file names none).
    pub fn tenant_tiers(&self, partition: &str) -> Vec<Tier> {
        self.tenant_tiers.get(partition).or_else(|| self.tenant_tiers.get("*")).cloned().unwrap_or_else(|| Tier::ALL.to_vec())
    }

    /// Refuses a component whose digest is not allow-listed (when a list is set).
    pub fn allow_component(&self, sha256: &str) -> Result<(), ServeError> {
        match &self.allowed_components {
            Some(list) if !list.iter().any(|h| h == sha256) => {
                Err(ServeError::PermissionDenied(format!("component {sha256} is not on the allow-list")))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_are_per_partition_with_a_default() {
        let a = Access::parse(
            r#"
            [[identities]]
            name = "t"
            token = "tenant-token"
            roles = { "*" = "viewer", "gpu" = "tenant" }
            "#,
        )
        .unwrap();
        let id = &a.tokens[0].1;
        assert!(id.require("gpu", Role::Tenant).is_ok());
        assert!(id.require("other", Role::Tenant).is_err());
        assert!(id.require("other", Role::Viewer).is_ok());
        assert!(id.require("gpu", Role::Operator).is_err());
    }

    #[test]
    fn priority_ceiling_is_per_partition_with_a_default() {
        let a = Access::parse(
            "tenant_max_priority = { \"*\" = 50, \"batch\" = 5 }\n[[identities]]\nname = \"t\"\ntoken = \"tenant-token\"\nroles = {}",
        )
        .unwrap();
        assert_eq!(a.priority_ceiling("batch"), Some(5));
        assert_eq!(a.priority_ceiling("gpu"), Some(50));
        let none = Access::parse("[[identities]]\nname = \"t\"\ntoken = \"tenant-token\"\nroles = {}").unwrap();
        assert_eq!(none.priority_ceiling("gpu"), None);
    }

    #[test]
    fn tiers_are_per_partition_with_defaults_and_unknown_names_are_refused() {
        let a = Access::parse(
            "tenant_tiers = { \"*\" = [\"preemptible\"], \"prod\" = [\"guaranteed\", \"preemptible\"], \"scavenge\" = [\"opportunistic\"] }\ndefault_tier = { \"scavenge\" = \"opportunistic\" }\n[[identities]]\nname = \"t\"\ntoken = \"tenant-token\"\nroles = {}",
        )
        .unwrap();
        assert_eq!(a.tenant_tiers("prod"), vec![Tier::Guaranteed, Tier::Preemptible]);
        assert_eq!(a.tenant_tiers("batch"), vec![Tier::Preemptible]);
        assert_eq!((a.default_tier("scavenge"), a.default_tier("prod")), (Tier::Opportunistic, Tier::Preemptible));
        let open = Access::parse("[[identities]]\nname = \"t\"\ntoken = \"tenant-token\"\nroles = {}").unwrap();
        assert_eq!(open.tenant_tiers("any"), Tier::ALL.to_vec());
        let bad = Access::parse("default_tier = { \"p\" = \"gold\" }\n[[identities]]\nname = \"t\"\ntoken = \"tenant-token\"\nroles = {}").unwrap_err();
        assert!(format!("{bad:#}").contains("default_tier.p: tier \"gold\""), "{bad:#}");
        // A default tenants may not buy would refuse every job naming none.
        let unbuyable = Access::parse(
            "tenant_tiers = { \"*\" = [\"preemptible\"] }\ndefault_tier = { \"p\" = \"opportunistic\" }\n[[identities]]\nname = \"t\"\ntoken = \"tenant-token\"\nroles = {}",
        )
        .unwrap_err();
        assert!(format!("{unbuyable:#}").contains("default_tier.p: opportunistic is not among"), "{unbuyable:#}");
    }

    #[test]
    fn an_agent_identity_acts_only_as_its_nodes_and_reads_nothing() {
        let a = Access::parse(
            "[[identities]]\nname = \"rack\"\ntoken = \"agent-token\"\nroles = { \"p0\" = \"agent\" }\nnodes = [\"n1\", \"rack7-*\"]\n\
             [[identities]]\nname = \"ops\"\ntoken = \"ops-token\"\nroles = { \"*\" = \"operator\" }",
        )
        .unwrap();
        let (agent, ops) = (&a.tokens[0].1, &a.tokens[1].1);
        assert!(agent.may_act_as_node("p0", "n1") && agent.may_act_as_node("p0", "rack7-12"));
        assert!(!agent.may_act_as_node("p0", "n2") && !agent.may_act_as_node("p1", "n1"));
        assert!(agent.could_act_as_node("rack7-1") && !agent.could_act_as_node("n10"));
        assert!(!agent.can_view("p0") && agent.require("p0", Role::Viewer).is_err());
        assert!(ops.may_act_as_node("p5", "anything") && ops.can_view("p5"));
        // An agent role needs nodes; nodes need an agent role; patterns are names.
        assert!(Access::parse("[[identities]]\nname = \"x\"\ntoken = \"agent-token\"\nroles = { \"p0\" = \"agent\" }").is_err());
        assert!(Access::parse("[[identities]]\nname = \"x\"\ntoken = \"agent-token\"\nroles = { \"p0\" = \"viewer\" }\nnodes = [\"n1\"]").is_err());
        assert!(Access::parse("[[identities]]\nname = \"x\"\ntoken = \"agent-token\"\nroles = { \"p0\" = \"agent\" }\nnodes = [\"../x\"]").is_err());
    }

    #[test]
    fn node_names_are_plain() {
        for good in ["n1", "gpu-node-0042", "a.b_c", &"x".repeat(253)] {
            assert!(check_node_name(good).is_ok(), "{good}");
        }
        for bad in ["", "-n", ".n", "a/b", "a..b", "n\n1", "n\u{1b}[31m", "n\u{202e}", "n\0", "n 1", &"x".repeat(254)] {
            let e = check_node_name(bad).unwrap_err();
            assert!(!e.contains('\n') && !e.contains('\u{1b}') && e.len() < 400, "{e}");
        }
    }

    #[test]
    fn empty_or_weak_configs_are_refused() {
        assert!(Access::parse("identities = []").is_err());
        assert!(Access::parse("[[identities]]\nname = \"x\"\ntoken = \"short\"\nroles = {}").is_err());
        assert!(Access::parse("[[identities]]\nname = \"x\"\nroles = {}").is_err());
    }
}
