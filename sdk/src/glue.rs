//! The wasm side of the boundary: generated bindings and the moves between
//! them and the SDK's types. Only compiled for wasm32.

use crate::{Allocations, Domains, TaskClass, Level, Nodes, Plan, Policy, PoolExecutor, PoolPhase, PoolState, Scores, Snapshot, Task};

pub mod wit {
    wit_bindgen::generate!({
        path: "../wit/v0.4.0",
        world: "placement-policy",
        pub_export_macro: true,
        default_bindings_module: "berth_sdk::glue::wit",
    });
}

use wit::berth::policy::types as w;

pub fn log(level: Level, message: &str) {
    let level = match level {
        Level::Trace => w::Level::Trace,
        Level::Debug => w::Level::Debug,
        Level::Info => w::Level::Info,
        Level::Warn => w::Level::Warn,
        Level::Error => w::Level::Error,
    };
    wit::berth::policy::host::log(level, message);
}

pub fn info<P: Policy>() -> w::PolicyInfo {
    w::PolicyInfo {
        name: P::NAME.to_string(),
        version: P::VERSION.to_string(),
        hooks: w::Hooks::from_bits_truncate(P::HOOKS.bits()),
    }
}

fn task(t: w::Task) -> Task {
    Task {
        job_id: t.job_id,
        gpu_count: t.gpu_count,
        gpu_milli: t.gpu_milli,
        cpu_milli: t.cpu_milli,
        memory_mib: t.memory_mib,
        models: t.models,
        priority: t.priority,
        gang_size: t.gang_size,
        gang_index: t.gang_index,
        class: match t.class {
            w::TaskClass::Training => TaskClass::Training,
            w::TaskClass::Inference => TaskClass::Inference,
            w::TaskClass::CpuOnly => TaskClass::CpuOnly,
        },
    }
}

fn nodes(n: w::Nodes) -> Nodes {
    Nodes {
        ids: n.ids,
        model: n.model,
        models: n.models,
        switch_domain: n.switch_domain,
        cpu_free_milli: n.cpu_free_milli,
        cpu_total_milli: n.cpu_total_milli,
        memory_free_mib: n.memory_free_mib,
        memory_total_mib: n.memory_total_mib,
        gpu_count: n.gpu_count,
        gpu_start: n.gpu_start,
        gpu_free_milli: n.gpu_free_milli,
        alloc_kinds: n.alloc_kinds,
        gpu_tasks: n.gpu_tasks,
        cpu_only_milli: n.cpu_only_milli,
        cpu_used_milli: n.cpu_used_milli,
        cpu_pressure: n.cpu_pressure,
        memory_pressure: n.memory_pressure,
        io_pressure: n.io_pressure,
    }
}

fn allocations(a: w::Allocations) -> Allocations {
    Allocations {
        ids: a.ids,
        job_ids: a.job_ids,
        node: a.node,
        gpus: a.gpus,
        gpu_milli: a.gpu_milli,
        cpu_milli: a.cpu_milli,
        memory_mib: a.memory_mib,
        priority: a.priority,
        movable: a.movable,
        gang_id: a.gang_id,
        state_bytes: a.state_bytes,
        remaining_s: a.remaining_s,
        running_s: a.running_s,
        since_checkpoint_s: a.since_checkpoint_s,
        class: a.class,
        tier: a.tier,
        interruptions_left: a.interruptions_left,
    }
}

pub fn score<P: Policy>(p: &mut P, t: w::Task, n: w::Nodes) -> Result<w::Scores, String> {
    let s: Scores = p.score(&task(t), &nodes(n))?;
    Ok(w::Scores { scores: s.scores, gpus: s.gpus })
}

pub fn compact<P: Policy>(p: &mut P, s: w::Snapshot) -> Result<w::Plan, String> {
    let snapshot = Snapshot {
        nodes: nodes(s.nodes),
        allocations: allocations(s.allocations),
        pending: crate::Pending {
            gpu_count: s.pending.gpu_count,
            gpu_milli: s.pending.gpu_milli,
            whole_nodes: s.pending.whole_nodes,
            model: s.pending.model,
        },
    };
    let plan: Plan = p.compact(&snapshot)?;
    Ok(w::Plan { chain: plan.chain, allocation: plan.allocation, dest_node: plan.dest_node, dest_gpus: plan.dest_gpus })
}

pub fn rank<P: Policy>(p: &mut P, demand: w::Task, victims: w::Allocations) -> Result<Vec<u32>, String> {
    p.rank(&task(demand), &allocations(victims))
}

pub fn score_domains<P: Policy>(p: &mut P, t: w::Task, d: w::Domains) -> Result<Vec<f64>, String> {
    let domains = Domains {
        ids: d.ids,
        aggregation: d.aggregation,
        nodes: d.nodes,
        idle_nodes: d.idle_nodes,
        gpus_total: d.gpus_total,
        gpus_idle: d.gpus_idle,
        fitting_tasks: d.fitting_tasks,
    };
    p.score_domains(&task(t), &domains)
}

pub fn pool_place<P: Policy>(p: &mut P, s: w::PoolState) -> Result<w::PoolPlacement, String> {
    let state = PoolState {
        now_ms: s.now_ms,
        model_tp: s.model_tp,
        model_weight_bytes: s.model_weight_bytes,
        model_kv_bytes_per_token: s.model_kv_bytes_per_token,
        model_arrived: s.model_arrived,
        model_rate: s.model_rate,
        model_peak_rate: s.model_peak_rate,
        model_queued: s.model_queued,
        model_service_s: s.model_service_s,
        executor_tp: s.executor_tp,
        executor_memory_bytes: s.executor_memory_bytes,
        executor_load: s.executor_load,
        assigned_executor: s.assigned_executor,
        assigned_model: s.assigned_model,
        assigned_pinned: s.assigned_pinned,
        assigned_load: s.assigned_load,
        assigned_idle_ms: s.assigned_idle_ms,
    };
    let out = p.pool_place(&state)?;
    Ok(w::PoolPlacement { executor: out.executor, model: out.model, weight: out.weight, pinned: out.pinned })
}

pub fn pool_step<P: Policy>(p: &mut P, x: w::PoolExecutor) -> Result<w::PoolChoice, String> {
    let executor = PoolExecutor {
        now_ms: x.now_ms,
        executor: x.executor,
        memory_bytes: x.memory_bytes,
        used_bytes: x.used_bytes,
        tbt_target_ms: x.tbt_target_ms,
        model: x.model,
        resident: x.resident,
        pinned: x.pinned,
        weight_bytes: x.weight_bytes,
        load_s: x.load_s,
        waiting: x.waiting,
        waiting_tokens: x.waiting_tokens,
        oldest_wait_ms: x.oldest_wait_ms,
        decoding: x.decoding,
        decode_slack_ms: x.decode_slack_ms,
        decode_iteration_s: x.decode_iteration_s,
        idle_ms: x.idle_ms,
    };
    let step = p.pool_step(&executor)?;
    let phase = match step.phase {
        PoolPhase::Idle => w::PoolPhase::Idle,
        PoolPhase::Prefill => w::PoolPhase::Prefill,
        PoolPhase::Decode => w::PoolPhase::Decode,
    };
    Ok(w::PoolChoice { phase, row: step.row, iterations: step.iterations, evict: step.evict })
}
