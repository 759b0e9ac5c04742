//! A policy whose name is 1 MiB long: the host must refuse it at load with
//! a short error, so nothing of that size reaches a decision record, a log
//! line or a reply.

use berth_sdk::{Hooks, Nodes, Policy, Scores, Task};

const LONG: &[u8] = &[b'a'; 1 << 20];

#[derive(Default)]
struct Loud;

impl Policy for Loud {
    const NAME: &'static str = match std::str::from_utf8(LONG) {
        Ok(s) => s,
        Err(_) => panic!("ASCII"),
    };
    const VERSION: &'static str = "0.0.1";
    const HOOKS: Hooks = Hooks::SCORE;

    fn score(&mut self, _task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        Ok(Scores::from_scores(vec![0.0; nodes.len()]))
    }
}

berth_sdk::export!(Loud);
