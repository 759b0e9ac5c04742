//! The synthetic pool executor as a process: `berth executor` on a Unix
//! socket, driven through the executor protocol as an agent would. Its
//! loads, prefills and decodes take at least the pool cost model's times
//! (measured where the tokens arrive), tokens stream one by one in order,
//! memory never exceeds the executor's, requests that can never fit or
//! name a model not placed there are refused, bad lines are named and
//! skipped, and a pool-step policy that never answers gives way to the
//! default step without losing a request.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use berth_core::pool::{CostModel, GpuSpec, ModelSpec, PoolConfig, Slo};
use serde_json::{json, Value};

use crate::common::{guest_path, policy_path};

const BERTH: &str = env!("CARGO_BIN_EXE_berth");

/// Three small models on an 8 GB GPU, slowed so that every phase is long
/// enough to measure: model 0 (1 B parameters) and model 1 (2 B) are
/// placed, model 2 is not.
fn pool() -> PoolConfig {
    let model = |name: &str, params_b: f64| ModelSpec { name: name.into(), params_b, bytes_per_param: 2.0, tp: 1, kv_bytes_per_token: 200_000 };
    PoolConfig {
        gpu: GpuSpec { name: "test".into(), memory_gb: 8.0, ..GpuSpec::default() },
        // No host cache: every load reads the disk (the slowest, measurable).
        cost: CostModel { prefill_overhead_s: 0.2, iteration_overhead_s: 0.04, host_cache_gb: 0.0, ..CostModel::default() },
        slo: Slo::default(),
        replan_interval_s: 10.0,
        models: vec![model("a-1b", 1.0), model("b-2b", 2.0), model("c-1b", 1.0)],
    }
}

struct Executor {
    child: Child,
    to: UnixStream,
    from: BufReader<UnixStream>,
    _dir: PathBuf,
}

impl Executor {
    fn start(name: &str, policy: Option<&Path>) -> Executor {
        let dir = std::env::temp_dir().join(format!("berth-executor-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("executor.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let mut cmd = Command::new(BERTH);
        cmd.args(["executor", "--socket"]).arg(&socket).env("RUST_BACKTRACE", "0");
        if let Some(p) = policy {
            cmd.arg("--policy").arg(p).args(["--step-deadline-ms", "5"]);
        }
        let mut child = cmd.spawn().unwrap();
        listener.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                    assert!(child.try_wait().unwrap().is_none(), "berth executor exited before connecting");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("no connection from berth executor: {e}"),
            }
        };
        stream.set_nonblocking(false).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        Executor { child, to: stream.try_clone().unwrap(), from: BufReader::new(stream), _dir: dir }
    }

    fn send(&mut self, v: Value) {
        self.send_raw(&v.to_string());
    }

    fn send_raw(&mut self, line: &str) {
        self.to.write_all(line.as_bytes()).unwrap();
        self.to.write_all(b"\n").unwrap();
    }

    /// The next message and when it arrived.
    fn recv(&mut self) -> (Instant, Value) {
        let mut line = String::new();
        let n = self.from.read_line(&mut line).unwrap_or_else(|e| panic!("no message from the executor: {e}"));
        assert!(n > 0, "the executor closed the socket");
        (Instant::now(), serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}")))
    }

    fn shutdown(mut self) {
        self.send(json!({"type": "shutdown"}));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "berth executor exited with {status}");
                return;
            }
            assert!(Instant::now() < deadline, "berth executor did not exit after shutdown");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the test saw of a run: tokens per request with their arrival,
/// and every other message.
#[derive(Default)]
struct Seen {
    tokens: HashMap<u64, Vec<(u32, Instant)>>,
    done: HashMap<u64, Instant>,
    rejected: HashMap<u64, String>,
    others: Vec<Value>,
}

/// Reads until every id in `ids` is done or rejected.
fn until_finished(x: &mut Executor, cfg: &PoolConfig, ids: &[u64]) -> Seen {
    let mut seen = Seen::default();
    while !ids.iter().all(|id| seen.done.contains_key(id) || seen.rejected.contains_key(id)) {
        let (at, m) = x.recv();
        match m["type"].as_str().unwrap() {
            "token" => seen.tokens.entry(m["id"].as_u64().unwrap()).or_default().push((m["index"].as_u64().unwrap() as u32, at)),
            "done" => {
                seen.done.insert(m["id"].as_u64().unwrap(), at);
            }
            "rejected" => {
                seen.rejected.insert(m["id"].as_u64().unwrap(), m["why"].as_str().unwrap().to_string());
            }
            "memory" => {
                let used = m["weights_bytes"].as_u64().unwrap() + m["kv_bytes"].as_u64().unwrap();
                assert!(used <= cfg.executor_memory(1), "over-committed: {m}");
                seen.others.push(m);
            }
            _ => seen.others.push(m),
        }
    }
    seen
}

fn admit(x: &mut Executor, id: u64, model: u32, prompt: u32, output: u32) {
    x.send(json!({"type": "admit", "id": id, "model": model, "prompt_tokens": prompt, "output_tokens": output}));
}

fn configure(x: &mut Executor, cfg: &PoolConfig) {
    x.send(json!({"type": "configure", "executor": 0, "tp": 1, "pool": cfg}));
    let (_, ready) = x.recv();
    assert_eq!(ready, json!({"type": "ready", "executor": 0, "memory_bytes": cfg.executor_memory(1)}));
    x.send(json!({"type": "place", "rows": [{"model": 0, "weight": 1}, {"model": 1, "weight": 2}]}));
}

#[test]
fn a_synthetic_executor_serves_requests_at_the_cost_models_pace() {
    let cfg = pool();
    let mut x = Executor::start("pace", None);
    // Before configure, nothing else is taken.
    x.send(json!({"type": "admit", "id": 9, "model": 0, "prompt_tokens": 1, "output_tokens": 1}));
    let (_, e) = x.recv();
    assert_eq!(e["type"], "error");
    assert!(e["what"].as_str().unwrap().contains("admit before configure"), "{e}");
    configure(&mut x, &cfg);
    // Bad lines are named and skipped.
    x.send_raw("{\"type\": \"admit\", \"id\": 5}");
    x.send_raw("{\"type\": \"launch\"}");
    x.send_raw(&format!("{{\"type\": \"cancel\", \"id\": 1, \"pad\": \"{}\"}}", "x".repeat(2 << 20)));
    x.send(json!({"type": "place", "rows": [{"model": 2, "weight": 0}]}));
    // One write, so that the first step sees them all. Request 4 never
    // fits (40,960 tokens of KV cache at 200 KB beside 2 GB of weights);
    // model 2 is not placed here.
    let lines: Vec<String> = [(1, 0, 200, 12), (2, 0, 200, 12), (3, 1, 100, 6), (4, 0, 32_768, 8_192), (5, 2, 10, 10)]
        .iter()
        .map(|&(id, model, prompt, output)| json!({"type": "admit", "id": id, "model": model, "prompt_tokens": prompt, "output_tokens": output}).to_string())
        .collect();
    let sent = Instant::now();
    x.send_raw(&lines.join("\n"));
    let seen = until_finished(&mut x, &cfg, &[1, 2, 3, 4, 5]);
    let errors: Vec<&str> = seen.others.iter().filter(|m| m["type"] == "error").map(|m| m["what"].as_str().unwrap()).collect();
    assert_eq!(errors.len(), 4, "{errors:?}");
    assert!(errors[0].contains("missing field `model`"), "{errors:?}");
    assert!(errors[1].contains("unknown variant `launch`"), "{errors:?}");
    assert!(errors[2].contains("over 1048576 bytes"), "{errors:?}");
    assert!(errors[3].contains("model 2: weight 0"), "{errors:?}");
    assert!(seen.rejected[&4].contains("never fits"), "{:?}", seen.rejected);
    assert!(seen.rejected[&5].contains("model 2 is not placed"), "{:?}", seen.rejected);
    // Every token, in order, once.
    for (id, output) in [(1, 12), (2, 12), (3, 6)] {
        let idx: Vec<u32> = seen.tokens[&id].iter().map(|t| t.0).collect();
        assert_eq!(idx, (0..output).collect::<Vec<u32>>(), "request {id}");
    }
    // Model 0 loaded from disk at the modelled time, then requests 1 and 2
    // prefilled in one batch: the first token no earlier than load plus
    // prefill after the requests were sent.
    let load0 = cfg.load_s(0, false);
    assert!(seen.others.iter().any(|m| m["type"] == "loaded" && m["model"] == 0 && m["seconds"].as_f64() == Some(load0) && m["from_disk"] == true), "{:?}", seen.others);
    let first = seen.tokens[&1][0].1.duration_since(sent).as_secs_f64();
    let modelled = load0 + cfg.prefill_s(0, 400);
    assert!(first >= modelled - 0.005 && first < modelled + 5.0, "first token after {first:.3} s, modelled {modelled:.3} s");
    // Eleven decode iterations at least as long as the cost model's.
    let span = seen.done[&1].duration_since(seen.tokens[&1][0].1).as_secs_f64();
    let iteration = cfg.decode_iteration_s(0, 400);
    assert!(span >= 11.0 * iteration - 0.005, "11 iterations in {span:.3} s, modelled {:.3} s", 11.0 * iteration);
    // Both models fit beside each other: model 1 was loaded, nothing evicted.
    assert!(seen.others.iter().any(|m| m["type"] == "loaded" && m["model"] == 1), "{:?}", seen.others);
    assert!(!seen.others.iter().any(|m| m["type"] == "evicted"), "{:?}", seen.others);
    let steps: Vec<&Value> = seen.others.iter().filter(|m| m["type"] == "step").collect();
    assert!(steps.iter().any(|s| s["phase"] == "prefill" && s["model"] == 0 && s["batch"] == 2), "{steps:?}");
    assert!(steps.iter().all(|s| s["by"] == "default"), "{steps:?}");
    // A cancelled request stops; the KV cache it held is given back.
    admit(&mut x, 6, 1, 100, 400);
    let (_, m) = loop {
        let (at, m) = x.recv();
        if m["type"] == "token" && m["id"] == 6 && m["index"].as_u64() == Some(3) {
            break (at, m);
        }
    };
    assert_eq!(m["id"], 6);
    x.send(json!({"type": "cancel", "id": 6}));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, m) = x.recv();
        assert!(m["type"] != "done", "a cancelled request finished: {m}");
        if m["type"] == "memory" && m["kv_bytes"] == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the cancelled request's KV cache was not given back");
    }
    x.shutdown();
}

#[test]
fn a_pool_step_policy_that_never_answers_gives_way_to_the_default_step() {
    let cfg = pool();
    // A well-behaved policy decides every step.
    let mut x = Executor::start("token", Some(&policy_path("pool-token")));
    configure(&mut x, &cfg);
    admit(&mut x, 1, 0, 50, 4);
    admit(&mut x, 2, 1, 50, 4);
    let seen = until_finished(&mut x, &cfg, &[1, 2]);
    let by: Vec<&str> = seen.others.iter().filter(|m| m["type"] == "step").map(|m| m["by"].as_str().unwrap()).collect();
    assert!(!by.is_empty() && by.iter().all(|b| *b == "policy"), "{by:?}");
    x.shutdown();

    // hostile-pool's pool-step loops forever: each call is stopped at its
    // deadline, the default step runs instead, and after three the policy
    // is no longer asked. No request is lost.
    let mut x = Executor::start("hostile", Some(&guest_path("hostile-pool")));
    configure(&mut x, &cfg);
    for id in 1..=4 {
        admit(&mut x, id, (id % 2) as u32, 50, 4);
    }
    let seen = until_finished(&mut x, &cfg, &[1, 2, 3, 4]);
    assert!(seen.rejected.is_empty(), "{:?}", seen.rejected);
    for id in 1..=4 {
        assert_eq!(seen.tokens[&id].len(), 4, "request {id}");
    }
    let steps: Vec<&Value> = seen.others.iter().filter(|m| m["type"] == "step").collect();
    let fallbacks: Vec<&Value> = steps.iter().copied().filter(|s| s["by"] == "fallback").collect();
    assert_eq!(fallbacks.len(), 3, "{steps:?}");
    assert!(fallbacks.iter().all(|s| s["why"].as_str().is_some_and(|w| !w.is_empty())), "{fallbacks:?}");
    assert!(steps.iter().skip(3).all(|s| s["by"] == "default"), "{steps:?}");
    assert!(seen.others.iter().any(|m| m["type"] == "error" && m["what"].as_str().unwrap().contains("refused 3 times in a row")), "{:?}", seen.others);
    x.shutdown();
}
