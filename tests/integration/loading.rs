//! Loading: info, validation of what is loaded, the artifact cache.

use berth::wasm::{LoadedPolicy, PolicyEngine};
use berth_core::PolicyError;
use berth_sdk::Hooks;

use crate::common::{engine, policy_path};

#[test]
fn bundled_policies_describe_themselves() {
    for name in ["binpack", "spread"] {
        let p = crate::common::load(&policy_path(name));
        assert_eq!(p.info.name, name);
        assert_eq!(p.info.version, "1.0.0");
        assert_eq!(p.info.hooks, Hooks::SCORE);
        assert_eq!(p.hash.len(), 64);
    }
}

#[test]
fn garbage_is_a_load_error() {
    let err = LoadedPolicy::from_bytes(&engine(), b"\0asm not really").err().expect("must fail");
    assert!(matches!(err, PolicyError::Load(_)), "{err:?}");
}

#[test]
fn a_core_module_is_not_a_policy() {
    // A valid core module, but not a component exporting the contract.
    let module = wat_module();
    let err = LoadedPolicy::from_bytes(&engine(), &module).err().expect("must fail");
    assert!(matches!(err, PolicyError::Load(_)), "{err:?}");
}

fn wat_module() -> Vec<u8> {
    // (module) in binary form: magic + version.
    vec![0, b'a', b's', b'm', 1, 0, 0, 0]
}

#[test]
fn precompiled_artifacts_are_cached_by_content() {
    let dir = std::env::temp_dir().join(format!("berth-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let engine = PolicyEngine::new(Some(dir.clone())).unwrap();
    let bytes = std::fs::read(policy_path("binpack")).unwrap();
    let first = LoadedPolicy::from_bytes(&engine, &bytes).unwrap();
    let artifacts: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(artifacts.len(), 1);
    let name = artifacts[0].file_name().into_string().unwrap();
    assert!(name.starts_with(&first.hash), "{name}");
    let second = LoadedPolicy::from_bytes(&engine, &bytes).unwrap();
    assert_eq!(second.info, first.info);
    // A corrupted artifact is discarded and recompiled, not trusted.
    std::fs::write(artifacts[0].path(), b"corrupt").unwrap();
    let third = LoadedPolicy::from_bytes(&engine, &bytes).unwrap();
    assert_eq!(third.info, first.info);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn contract_0_1_0_components_keep_loading() {
    let old = crate::common::load(&crate::common::guest_path("v010"));
    assert_eq!(old.contract, "0.1.0");
    assert_eq!(old.info.name, "v010-most-free-cpu");
    // Rust policies build against the newest contract (0.4.0, contention);
    // best-fit-py stays a 0.2.0 component and loads side by side.
    assert_eq!(crate::common::load(&policy_path("binpack")).contract, "0.4.0");
    assert_eq!(crate::common::load(&policy_path("best-fit-py")).contract, "0.2.0");
    // It decides through the same core as new components.
    let mut policy = berth::wasm::WasmPolicy::new(engine(), old, Default::default());
    let mut fleet = berth::synth::fleet(8, 1, false);
    let shape = berth_core::TaskShape { gpu_count: 1, gpu_milli: 1000, cpu_milli: 100_000, memory_mib: 1, models: vec![] };
    let meta = berth_core::TaskMeta::default();
    let first = berth_core::Placer::new().place(&fleet, &shape, meta, &mut policy, None).unwrap().unwrap();
    fleet.allocate(&berth_core::Fleet::allocation(first.node, &shape, first.gpus)).unwrap();
    let second = berth_core::Placer::new().place(&fleet, &shape, meta, &mut policy, None).unwrap().unwrap();
    assert_ne!(first.node, second.node, "most free CPU moves on after the first node filled");
    // 0.1.0 has no domain hook: gangs fall back to topology-blind placement.
    let mut domains = berth_sdk::Domains { ids: vec![0], aggregation: vec![0], nodes: vec![1], idle_nodes: vec![1], gpus_total: vec![8], gpus_idle: vec![8], fitting_tasks: vec![1] };
    assert_eq!(policy.score_domains_raw(&berth_sdk::Task::default(), &mut domains).unwrap(), None);
}
