//! A deliberately hostile policy. What it does on `score` depends on the
//! task's `job_id`, so one component exercises every failure and a test can
//! follow each failure with an honest call on the same policy:
//!
//! 0 honest (score = free milli-GPU of the node) · 1 infinite loop ·
//! 2 memory bomb · 3 panic · 4 wrong number of scores · 5 NaN score ·
//! 6 GPU mask naming a GPU the node lacks · 7 huge output ·
//! 8 infinite score · 9 deep recursion (stack overflow) · 10 log flood
//! then honest · 11 returns a guest error · 12 returns an 8 MiB guest
//! error · 13 logs a line with newlines, ANSI escapes and bidi marks, then
//! honest · 14 leaks 16 MiB (kept across calls), then honest.
//! `configure("flaky")`: every odd job id fails with a guest error, every
//! even one is honest (a version that fails every other call; the host's
//! upload smoke test uses job 0).
//! `configure("slow")`: every call spins for a while, then is honest.
//! `configure("loud-errors")`: every call but job 0's (the upload smoke
//! test) fails with an 8 MiB error text.
//! `rank`: job 0 honest, 1 duplicate index, 2 out-of-range index.
//! `score-domains`: job 0 honest (all 0), 1 wrong length, 2 NaN.
//! `compact`: an empty plan when nothing is pending (the upload smoke
//! test); with pending shapes, `configure("compact-invalid")` plans a move
//! of an allocation that does not exist and `configure("compact-loop")`
//! never returns.
//! `configure("reject")` fails; anything else is accepted.

use berth_sdk::{Allocations, Domains, Hooks, Level, Nodes, Plan, Policy, Scores, Snapshot, Task};

#[derive(Default)]
struct Hostile {
    mode: Mode,
    /// What job 14 leaks: kept, so memory grows call after call.
    leaked: Vec<Vec<u8>>,
}

#[derive(Default, PartialEq)]
enum Mode {
    #[default]
    ByJob,
    Flaky,
    Slow,
    LoudErrors,
    CompactInvalid,
    CompactLoop,
}

fn honest(nodes: &Nodes) -> Scores {
    Scores::from_scores(nodes.iter().map(|n| n.gpu_free_total() as f64).collect())
}

#[inline(never)]
#[allow(unconditional_recursion)]
fn recurse(depth: u64, sink: &mut [u64; 64]) -> u64 {
    sink[(depth % 64) as usize] = depth;
    let mut local = [depth; 128];
    local[(depth % 128) as usize] ^= recurse(depth + 1, sink);
    local.iter().sum()
}

impl Policy for Hostile {
    const NAME: &'static str = "hostile";
    const VERSION: &'static str = "0.0.1";
    const HOOKS: Hooks = Hooks::SCORE.union(Hooks::RANK).union(Hooks::DOMAINS).union(Hooks::COMPACT);

    fn compact(&mut self, snapshot: &Snapshot) -> Result<Plan, String> {
        if snapshot.pending.gpu_count.is_empty() {
            return Ok(Plan::default());
        }
        match self.mode {
            Mode::CompactInvalid => Ok(Plan { chain: vec![0], allocation: vec![u32::MAX], dest_node: vec![0], dest_gpus: vec![0] }),
            Mode::CompactLoop => {
                let mut x = 0u64;
                loop {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            }
            _ => Ok(Plan::default()),
        }
    }

    fn score_domains(&mut self, task: &Task, domains: &Domains) -> Result<Vec<f64>, String> {
        Ok(match task.job_id {
            1 => vec![0.0; domains.len() + 3],
            2 => vec![f64::NAN; domains.len()],
            _ => vec![0.0; domains.len()],
        })
    }

    fn configure(&mut self, config: &str) -> Result<(), String> {
        self.mode = match config {
            "reject" => return Err("configuration rejected on purpose".into()),
            "flaky" => Mode::Flaky,
            "slow" => Mode::Slow,
            "loud-errors" => Mode::LoudErrors,
            "compact-invalid" => Mode::CompactInvalid,
            "compact-loop" => Mode::CompactLoop,
            _ => Mode::ByJob,
        };
        Ok(())
    }

    fn score(&mut self, task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        match self.mode {
            Mode::Flaky if task.job_id % 2 == 1 => return Err(format!("flaky on odd job {}", task.job_id)),
            Mode::Slow => {
                // No clock in the sandbox: spin a fixed amount of work
                // (tens of ms natively, far under any deadline).
                let mut x: u64 = task.job_id;
                for _ in 0..60_000_000u64 {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
                std::hint::black_box(x);
                return Ok(honest(nodes));
            }
            Mode::LoudErrors if task.job_id != 0 => return Err("E".repeat(8 << 20)),
            Mode::CompactInvalid | Mode::CompactLoop => return Ok(honest(nodes)),
            Mode::Flaky | Mode::ByJob | Mode::LoudErrors => {}
        }
        match task.job_id {
            1 => {
                let mut x: u64 = 1;
                loop {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            }
            2 => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 16 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            3 => panic!("hostile guest panics on purpose"),
            4 => Ok(Scores::from_scores(vec![1.0; nodes.len() + 1])),
            5 => {
                let mut s = honest(nodes);
                s.scores[0] = f64::NAN;
                Ok(s)
            }
            6 => {
                let mut s = honest(nodes);
                s.gpus = vec![1u64 << 63; nodes.len()];
                Ok(s)
            }
            7 => Ok(Scores::from_scores(vec![0.5; 6_000_000])),
            8 => {
                let mut s = honest(nodes);
                s.scores[nodes.len() - 1] = f64::INFINITY;
                Ok(s)
            }
            9 => {
                let mut sink = [0u64; 64];
                Ok(Scores::from_scores(vec![recurse(0, &mut sink) as f64; nodes.len()]))
            }
            10 => {
                for i in 0..100_000 {
                    berth_sdk::log(Level::Info, &format!("flood line {i}"));
                }
                Ok(honest(nodes))
            }
            11 => Err("hostile guest declines to score".into()),
            12 => Err("E".repeat(8 << 20)),
            13 => {
                berth_sdk::log(Level::Warn, &format!("forged\nINFO berth: all good \x1b[31mred\u{202e}desrever{}", "x".repeat(100_000)));
                Ok(honest(nodes))
            }
            14 => {
                self.leaked.push(vec![1u8; 16 << 20]);
                std::hint::black_box(&self.leaked);
                Ok(honest(nodes))
            }
            _ => Ok(honest(nodes)),
        }
    }

    fn rank(&mut self, demand: &Task, victims: &Allocations) -> Result<Vec<u32>, String> {
        let n = victims.len() as u32;
        // Priority 77: always out of range, whatever the job (live tests
        // cannot choose job ids).
        if demand.priority == 77 {
            return Ok(vec![n + 7]);
        }
        Ok(match demand.job_id {
            1 => vec![0, 0],
            2 => vec![n + 5],
            _ => (0..n).rev().collect(),
        })
    }
}

berth_sdk::export!(Hostile);
