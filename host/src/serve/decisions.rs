//! The decision log: every placement decision, actuated or shadow, with the
//! policy version and content hash that made it, a digest of its input, the
//! result and the latency. The newest entries stay in memory for queries;
//! all are appended to `decisions.jsonl` in the state directory.

use std::collections::VecDeque;
use std::io::{BufRead, Write};
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Placed {
    pub node: String,
    pub gpus: Vec<u32>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DecisionRecord {
    pub id: u64,
    pub unix_ms: u64,
    pub partition: String,
    pub job_id: u64,
    /// Who submitted the job.
    pub actor: String,
    /// active, candidate (split arm) or shadow.
    pub arm: String,
    pub actuated: bool,
    pub policy: String,
    pub policy_semver: String,
    pub policy_version: u32,
    pub sha256: String,
    pub input_digest: String,
    /// placed, unplaced or error.
    pub outcome: String,
    pub detail: String,
    pub placements: Vec<Placed>,
    pub latency_us: u64,
}

/// What a query selects.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    pub partition: Option<String>,
    pub job_id: Option<u64>,
    pub policy_version: Option<u32>,
    pub include_shadow: bool,
    pub limit: usize,
}

struct Inner {
    recent: VecDeque<DecisionRecord>,
    next_id: u64,
    max_job_id: u64,
    file: Option<std::io::BufWriter<std::fs::File>>,
}

pub struct DecisionLog {
    inner: Mutex<Inner>,
    keep: usize,
}

impl DecisionLog {
    /// Opens the log in `dir` (continuing its numbering), or an in-memory
    /// one; keeps the newest `keep` entries queryable.
    pub fn open(dir: Option<&Path>, keep: usize) -> std::io::Result<DecisionLog> {
        let mut recent = VecDeque::new();
        let mut next_id = 1;
        let mut max_job_id = 0;
        let file = match dir {
            Some(dir) => {
                let path = dir.join("decisions.jsonl");
                if let Ok(f) = std::fs::File::open(&path) {
                    for line in std::io::BufReader::new(f).lines() {
                        // A torn last line (a crash mid-write) is skipped.
                        if let Ok(rec) = serde_json::from_str::<DecisionRecord>(&line?) {
                            next_id = next_id.max(rec.id + 1);
                            max_job_id = max_job_id.max(rec.job_id);
                            recent.push_back(rec);
                            if recent.len() > keep {
                                recent.pop_front();
                            }
                        }
                    }
                }
                Some(std::io::BufWriter::new(std::fs::OpenOptions::new().create(true).append(true).open(&path)?))
            }
            None => None,
        };
        Ok(DecisionLog { inner: Mutex::new(Inner { recent, next_id, max_job_id, file }), keep })
    }

    /// The largest job id any logged decision names: jobs of a restarted
    /// server are numbered after it, so the log never mixes two jobs.
    pub fn max_job_id(&self) -> u64 {
        self.inner.lock().unwrap().max_job_id
    }

    /// Numbers and stores a decision; returns its id.
    pub fn append(&self, mut rec: DecisionRecord) -> u64 {
        let mut inner = self.inner.lock().unwrap();
        rec.id = inner.next_id;
        inner.next_id += 1;
        if let Some(f) = inner.file.as_mut() {
            let line = serde_json::to_string(&rec).expect("records serialize");
            if let Err(e) = writeln!(f, "{line}").and_then(|_| f.flush()) {
                tracing::error!(target: "berth::serve", "decision log write failed: {e}");
            }
        }
        let id = rec.id;
        inner.max_job_id = inner.max_job_id.max(rec.job_id);
        inner.recent.push_back(rec);
        if inner.recent.len() > self.keep {
            inner.recent.pop_front();
        }
        id
    }

    /// Matching decisions, newest first.
    pub fn query(&self, f: &Filter) -> Vec<DecisionRecord> {
        let inner = self.inner.lock().unwrap();
        inner
            .recent
            .iter()
            .rev()
            .filter(|r| f.partition.as_ref().is_none_or(|p| *p == r.partition))
            .filter(|r| f.job_id.is_none_or(|j| j == r.job_id))
            .filter(|r| f.policy_version.is_none_or(|v| v == r.policy_version))
            .filter(|r| f.include_shadow || r.actuated)
            .take(f.limit)
            .cloned()
            .collect()
    }
}
