use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use berth::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn component(dir: &str, name: &str) -> PathBuf {
    let path = repo_root().join("target").join(dir).join(format!("{name}.wasm"));
    assert!(path.is_file(), "{} is missing: run scripts/build-policies.sh first", path.display());
    path
}

pub fn policy_path(name: &str) -> PathBuf {
    component("policies", name)
}

pub fn guest_path(name: &str) -> PathBuf {
    component("test-guests", name)
}

/// One engine for the whole test binary, with no artifact cache unless a
/// test asks for one.
pub fn engine() -> Arc<PolicyEngine> {
    static ENGINE: OnceLock<Arc<PolicyEngine>> = OnceLock::new();
    ENGINE.get_or_init(|| Arc::new(PolicyEngine::new(None).expect("engine"))).clone()
}

pub fn load(path: &std::path::Path) -> Arc<LoadedPolicy> {
    LoadedPolicy::from_file(&engine(), path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}

pub fn wasm_policy(path: &std::path::Path, limits: Limits) -> WasmPolicy {
    WasmPolicy::new(engine(), load(path), limits)
}

/// The one skip gate. Where a test's tool, browser, kernel feature or data
/// set is missing it may skip, saying why, on a developer's machine; under
/// CI (`CI` set to anything but empty, `0` or `false`) or with
/// `BERTH_REQUIRE_TRACES` set, a missing part fails the run instead.
pub fn skip(what: &str) {
    let set = |v: &str| std::env::var(v).is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"));
    assert!(!set("CI") && !set("BERTH_REQUIRE_TRACES"), "{what} (required under CI)");
    eprintln!("SKIPPED: {what}");
}

/// Held by the tests that measure how fast a task runs against CPUs they
/// load on purpose (hogs pinned to one CPU), and by the heaviest builds:
/// two of them at once would each read the other's load as their own
/// result (a clean-clone CI run saw a task's rate before a move fall to a
/// ninth while other tests built).
pub fn cpu_measuring() -> std::sync::MutexGuard<'static, ()> {
    static CPU: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A test that failed holding it poisons nothing the next one needs.
    CPU.lock().unwrap_or_else(|e| e.into_inner())
}
