//! The same policy sources compiled natively: for benchmarks (wasm against
//! native on identical logic) and equivalence tests. Not a production path:
//! native code is not sandboxed.

use berth_core::{PlacementPolicy, PolicyError};
use berth_sdk::{Domains, Hooks, Nodes, Policy, Scores, Task};

/// Adapts an SDK policy, compiled into this binary, to the core's trait.
#[derive(Default)]
pub struct NativePolicy<P: Policy>(pub P);

impl<P: Policy> NativePolicy<P> {
    pub fn configure(&mut self, config: &str) -> Result<(), PolicyError> {
        self.0.configure(config).map_err(PolicyError::Guest)
    }
}

impl<P: Policy> PlacementPolicy for NativePolicy<P> {
    fn describe(&self) -> String {
        format!("{}@{} (native)", P::NAME, P::VERSION)
    }
    fn score(&mut self, task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        self.0.score(task, nodes).map_err(PolicyError::Guest)
    }
    fn score_domains(&mut self, task: &Task, domains: &mut Domains) -> Result<Option<Vec<f64>>, PolicyError> {
        if !P::HOOKS.contains(Hooks::DOMAINS) {
            return Ok(None);
        }
        self.0.score_domains(task, domains).map(Some).map_err(PolicyError::Guest)
    }
}

impl<P: Policy> berth_core::compaction::CompactionPolicy for NativePolicy<P> {
    fn describe(&self) -> String {
        format!("{}@{} (native)", P::NAME, P::VERSION)
    }
    fn compact(&mut self, snapshot: &mut berth_sdk::Snapshot) -> Result<berth_sdk::Plan, PolicyError> {
        if !P::HOOKS.contains(Hooks::COMPACT) {
            return Err(PolicyError::Unsupported("compact"));
        }
        self.0.compact(snapshot).map_err(PolicyError::Guest)
    }
}

/// Names of the policies this binary also carries natively.
pub const NATIVE_POLICIES: &[&str] =
    &["binpack", "spread", "random", "dotprod", "gpu-clustering", "gpu-packing", "best-fit", "fgd", "topo-entropy", "berth-frag", "interference-aware"];

/// A native build of a bundled policy, by its name.
pub fn by_name(name: &str) -> Option<Box<dyn NativeScorer>> {
    match name {
        "binpack" => Some(Box::new(NativePolicy::<berth_policy_binpack::Binpack>::default())),
        "spread" => Some(Box::new(NativePolicy::<berth_policy_spread::Spread>::default())),
        "random" => Some(Box::new(NativePolicy::<berth_policy_random::Random>::default())),
        "dotprod" => Some(Box::new(NativePolicy::<berth_policy_dotprod::DotProd>::default())),
        "gpu-clustering" => Some(Box::new(NativePolicy::<berth_policy_gpu_clustering::GpuClustering>::default())),
        "gpu-packing" => Some(Box::new(NativePolicy::<berth_policy_gpu_packing::GpuPacking>::default())),
        "best-fit" => Some(Box::new(NativePolicy::<berth_policy_best_fit::BestFit>::default())),
        "fgd" => Some(Box::new(NativePolicy::<berth_policy_fgd::Fgd>::default())),
        "topo-entropy" => Some(Box::new(NativePolicy::<berth_policy_topo_entropy::TopoEntropy>::default())),
        "berth-frag" => Some(Box::new(NativePolicy::<berth_policy_berth_frag::BerthFrag>::default())),
        "interference-aware" => Some(Box::new(NativePolicy::<berth_policy_interference_aware::InterferenceAware>::default())),
        _ => None,
    }
}

/// A native policy that can also take its configuration.
pub trait NativeScorer: PlacementPolicy + Send {
    fn configure(&mut self, config: &str) -> Result<(), PolicyError>;
}

impl<P: Policy + Send> NativeScorer for NativePolicy<P> {
    fn configure(&mut self, config: &str) -> Result<(), PolicyError> {
        NativePolicy::configure(self, config)
    }
}
