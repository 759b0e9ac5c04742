//! Prometheus metrics of the live host, served as text at `/metrics`.

use prometheus::{Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

pub struct Metrics {
    registry: Registry,
    /// partition, policy, version, arm, outcome
    pub decisions: IntCounterVec,
    /// partition, policy, version, arm
    pub decision_seconds: HistogramVec,
    /// partition: one whole pass (queue walk, policy calls, actuation, store)
    pub pass_seconds: HistogramVec,
    /// partition, policy, version, kind (trap, timeout, ...)
    pub policy_failures: IntCounterVec,
    /// partition, reason (activate, rollback, breaker)
    pub swaps: IntCounterVec,
    /// partition
    pub swap_seconds: HistogramVec,
    /// partition, version
    pub breaker_trips: IntCounterVec,
    /// partition, agree (true/false)
    pub shadow_samples: IntCounterVec,
    /// partition, state: jobs kept (ended ones until their retention runs out)
    pub jobs: IntGaugeVec,
    /// partition: ended jobs removed past their retention
    pub jobs_pruned: IntCounterVec,
    /// partition, what: a record the host found inconsistent with itself
    /// (logged and left fenced instead of a panic under the state lock)
    pub invariant_breaks: IntCounterVec,
    /// Records of what happened whose store writes failed, waiting for the
    /// next write that succeeds.
    pub store_unwritten: prometheus::IntGauge,
    /// code (unauthenticated, permission_denied)
    pub api_denials: IntCounterVec,
    /// Preemptions by kind (preempt: for higher-priority work; wake: a
    /// sleeping job takes its lent GPUs back), and the GPU-seconds of work
    /// they lost (since the victims' last checkpoints).
    pub evictions: IntCounterVec,
    /// Preempted tasks gone, by how (exited within the stop grace, or
    /// killed after it), and the seconds from the stop to the exit, as the
    /// agents measured them.
    pub eviction_exits: IntCounterVec,
    pub eviction_stop_to_exit: HistogramVec,
    pub lost_gpu_seconds: prometheus::CounterVec,
    pub credit_gpu_hours: prometheus::CounterVec,
    pub broken_promises: prometheus::IntCounterVec,
    /// Live compaction: chains by how they ended (done, rolled-back,
    /// abandoned), moves by how they ended, whole nodes freed.
    pub compaction_chains: IntCounterVec,
    pub compaction_moves: IntCounterVec,
    pub compaction_nodes_freed: IntCounterVec,
    /// Sleep-state harvesting: jobs put to sleep, woken, borrowers evicted
    /// for a wake, wakes that could not get their GPUs back.
    pub harvest: IntCounterVec,
    /// partition, unit: work tasks reported done (`berth progress`), and
    /// the part of it lost (see [`super::outcome`]).
    pub work_done: IntCounterVec,
    pub work_lost: IntCounterVec,
    /// Work units named in labels so far: tenants name units, so beyond
    /// [`MAX_UNIT_LABELS`] they are counted as "other".
    unit_labels: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// partition, node, resource (cpu, memory, io): the node's pressure,
    /// the share of the last 10 s some task waited (PSI "some avg10").
    pub node_pressure: prometheus::GaugeVec,
    /// partition, node, tasks (all, cpu_only): cores the node's tasks used
    /// since its previous heartbeat.
    pub node_task_cores: prometheus::GaugeVec,
    /// partition: tasks the kernel killed over their memory limit.
    pub oom_kills: IntCounterVec,
    /// Model pools, by partition and model (catalog names, bounded by the
    /// fleet config): requests by outcome (slo_met, slo_missed, rejected,
    /// failed, cancelled), time to first token and between tokens as the
    /// host saw them, weight loads (model switches), executor steps by who
    /// chose them, executors by state.
    pub pool_requests: IntCounterVec,
    pub pool_ttft_seconds: HistogramVec,
    pub pool_tbt_seconds: HistogramVec,
    pub pool_switches: IntCounterVec,
    pub pool_steps: IntCounterVec,
    pub pool_executors: IntGaugeVec,
}

/// Distinct work units the metrics name (a bound on label cardinality).
pub const MAX_UNIT_LABELS: usize = 32;

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("registered once");
            c
        };
        let histogram = |name: &str, help: &str, labels: &[&str], buckets: Vec<f64>| {
            let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels).expect("valid metric");
            registry.register(Box::new(h.clone())).expect("registered once");
            h
        };
        let latency = vec![1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0];
        let jobs = IntGaugeVec::new(Opts::new("berth_jobs", "Jobs kept by partition and state (ended ones until their retention runs out)"), &["partition", "state"]).expect("valid");
        registry.register(Box::new(jobs.clone())).expect("registered once");
        Metrics {
            decisions: counter(
                "berth_decisions_total",
                "Placement decisions by policy version, arm and outcome",
                &["partition", "policy", "version", "arm", "outcome"],
            ),
            decision_seconds: histogram(
                "berth_decision_seconds",
                "Latency of one placement decision (all tasks of a job)",
                &["partition", "policy", "version", "arm"],
                latency.clone(),
            ),
            pass_seconds: histogram(
                "berth_pass_seconds",
                "Duration of one whole pass of a partition (queue walk, policy calls, validation, actuation, store writes)",
                &["partition"],
                latency.clone(),
            ),
            policy_failures: counter(
                "berth_policy_failures_total",
                "Failed policy calls by kind (trap, timeout, out_of_memory, invalid_output, guest_error)",
                &["partition", "policy", "version", "kind"],
            ),
            swaps: counter("berth_policy_swaps_total", "Active policy changes", &["partition", "reason"]),
            swap_seconds: histogram(
                "berth_policy_swap_seconds",
                "From an activation request to the new version deciding (load from the precompiled artifact, instantiate, swap)",
                &["partition"],
                latency,
            ),
            breaker_trips: counter("berth_breaker_trips_total", "Circuit breaker trips", &["partition", "version"]),
            shadow_samples: counter("berth_shadow_samples_total", "Shadow comparisons by agreement", &["partition", "agree"]),
            jobs,
            jobs_pruned: counter("berth_jobs_pruned_total", "Ended jobs removed from memory and the store past their retention", &["partition"]),
            invariant_breaks: counter("berth_invariant_breaks_total", "Records the host found inconsistent (logged, left held; never a panic): any is a bug", &["partition", "what"]),
            store_unwritten: {
                let g = prometheus::IntGauge::new("berth_store_unwritten", "Records whose store writes failed, written ahead of the next write that succeeds").expect("valid metric");
                registry.register(Box::new(g.clone())).expect("registered once");
                g
            },
            api_denials: counter("berth_api_denials_total", "API calls refused by access control", &["code"]),
            evictions: counter("berth_evictions_total", "Running jobs preempted (kind: preempt for higher-priority work, wake for a sleeping job's lent GPUs)", &["partition", "kind"]),
            eviction_exits: counter("berth_eviction_exits_total", "Preempted tasks gone, by how: exited within the stop grace, or killed after it", &["partition", "how"]),
            eviction_stop_to_exit: histogram(
                "berth_eviction_stop_to_exit_seconds",
                "Seconds from a preempted task's stop to its exit, as its agent measured (else as the host saw it from the scheduled stop)",
                &["partition"],
                vec![0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0],
            ),
            compaction_chains: counter("berth_compaction_chains_total", "Live compaction chains by how they ended", &["partition", "state"]),
            compaction_moves: counter("berth_compaction_moves_total", "Live compaction moves by how they ended", &["partition", "state"]),
            compaction_nodes_freed: counter("berth_compaction_nodes_freed_total", "Whole GPU nodes left idle by completed compaction chains", &["partition"]),
            harvest: counter("berth_harvest_events_total", "Sleep-state harvesting: sleep, wake, wake_eviction, wake_failure", &["partition", "event"]),
            lost_gpu_seconds: {
                let c = prometheus::CounterVec::new(Opts::new("berth_lost_gpu_seconds_total", "GPU-seconds of work lost to preemption"), &["partition"]).expect("valid metric");
                registry.register(Box::new(c.clone())).expect("registered once");
                c
            },
            credit_gpu_hours: {
                let c = prometheus::CounterVec::new(Opts::new("berth_credit_gpu_hours_total", "GPU-hours credited to tenants for work lost to preemption and broken promises"), &["partition", "tenant"]).expect("valid metric");
                registry.register(Box::new(c.clone())).expect("registered once");
                c
            },
            broken_promises: counter("berth_broken_promises_total", "Promises the host broke: past-cap, outage, guaranteed-stopped", &["partition", "tenant", "promise"]),
            work_done: counter("berth_work_done_total", "Work tasks reported done (berth progress), in the jobs' units", &["partition", "unit"]),
            work_lost: counter("berth_work_lost_total", "Reported work lost: done after a run's last checkpoint by a run preempted, migrated, failed or lost", &["partition", "unit"]),
            unit_labels: Default::default(),
            node_pressure: {
                let g = prometheus::GaugeVec::new(Opts::new("berth_node_pressure_ratio", "Share of the last 10 s some task on the agent node waited for the resource (PSI some avg10)"), &["partition", "node", "resource"]).expect("valid metric");
                registry.register(Box::new(g.clone())).expect("registered once");
                g
            },
            node_task_cores: {
                let g = prometheus::GaugeVec::new(Opts::new("berth_node_task_cores", "Cores the agent node's tasks used since its previous heartbeat (all, or those holding no GPU)"), &["partition", "node", "tasks"]).expect("valid metric");
                registry.register(Box::new(g.clone())).expect("registered once");
                g
            },
            oom_kills: counter("berth_task_oom_kills_total", "Tasks the kernel killed over their memory limit", &["partition"]),
            pool_requests: counter("berth_pool_requests_total", "Pool requests by model and outcome (slo_met, slo_missed, rejected, failed, cancelled)", &["partition", "model", "outcome"]),
            pool_ttft_seconds: histogram(
                "berth_pool_ttft_seconds",
                "Pool requests: seconds from arrival at the endpoint to the first token",
                &["partition", "model"],
                vec![0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0],
            ),
            pool_tbt_seconds: histogram(
                "berth_pool_tbt_seconds",
                "Pool requests: seconds between two tokens of one request",
                &["partition", "model"],
                vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0],
            ),
            pool_switches: counter("berth_pool_switches_total", "Model weights loaded onto a pool executor (switches)", &["partition", "model"]),
            pool_steps: counter("berth_pool_steps_total", "Pool executor steps by who chose them (policy, default, fallback)", &["partition", "by"]),
            pool_executors: {
                let g = IntGaugeVec::new(Opts::new("berth_pool_executors", "Pool executors by state (ready, starting, missing) and tensor-parallel degree"), &["partition", "tp", "state"]).expect("valid");
                registry.register(Box::new(g.clone())).expect("registered once");
                g
            },
            registry,
        }
    }

    /// Counts `done` and `lost` units of work of a job in `unit`.
    pub fn work(&self, partition: &str, unit: &str, done: u64, lost: u64) {
        if done == 0 && lost == 0 {
            return;
        }
        let label = {
            let mut seen = self.unit_labels.lock().unwrap();
            if seen.contains(unit) || (seen.len() < MAX_UNIT_LABELS && seen.insert(unit.to_string())) { unit } else { "other" }
        };
        // Saturating: the counters wrap, and tasks write their own counts.
        for (counter, n) in [(&self.work_done, done), (&self.work_lost, lost)] {
            if n > 0 {
                let c = counter.with_label_values(&[partition, label]);
                c.inc_by(n.min(u64::MAX - c.get()));
            }
        }
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf).expect("text encoding cannot fail");
        String::from_utf8(buf).expect("the text format is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
