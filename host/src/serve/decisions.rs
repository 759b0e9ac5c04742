//! The decision log: every placement decision, actuated or shadow, with the
//! policy version and content hash that made it, a digest of its input, the
//! result and the latency. The newest entries stay in memory for queries;
//! all are appended to `decisions.jsonl` in the state directory, which is
//! rotated by size (`decisions.1.jsonl`, ... ; the oldest deleted).

use std::collections::VecDeque;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
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
    file: Option<LogFile>,
}

/// The file decisions are appended to, rotated by size.
struct LogFile {
    dir: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
    bytes: u64,
    rotation: Rotation,
}

/// When the log's file is rotated, and how many rotated files stay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rotation {
    /// Past this many bytes the file becomes `decisions.1.jsonl`.
    pub max_bytes: u64,
    /// Rotated files kept (`decisions.1.jsonl` the newest); older ones are deleted.
    pub keep_files: usize,
}

impl Default for Rotation {
    fn default() -> Self {
        Rotation { max_bytes: 64 << 20, keep_files: 2 }
    }
}

fn log_path(dir: &Path, generation: usize) -> PathBuf {
    if generation == 0 { dir.join("decisions.jsonl") } else { dir.join(format!("decisions.{generation}.jsonl")) }
}

/// Decisions in the file at `path` (none when it is missing; a torn last
/// line, from a crash mid-write, is skipped).
fn read_log(path: &Path) -> std::io::Result<Vec<DecisionRecord>> {
    let Ok(f) = std::fs::File::open(path) else { return Ok(Vec::new()) };
    let mut out = Vec::new();
    for line in std::io::BufReader::new(f).lines() {
        if let Ok(rec) = serde_json::from_str::<DecisionRecord>(&line?) {
            out.push(rec);
        }
    }
    Ok(out)
}

impl LogFile {
    fn write(&mut self, line: &str) -> std::io::Result<()> {
        writeln!(self.out, "{line}")?;
        self.out.flush()?;
        self.bytes += line.len() as u64 + 1;
        if self.bytes > self.rotation.max_bytes {
            self.rotate()?;
        }
        Ok(())
    }

    /// decisions.jsonl becomes decisions.1.jsonl (each older one moves up
    /// a number, the oldest past `keep_files` is deleted); a new file starts.
    fn rotate(&mut self) -> std::io::Result<()> {
        let keep = self.rotation.keep_files;
        let _ = std::fs::remove_file(log_path(&self.dir, keep.max(1)));
        for g in (1..keep).rev() {
            let from = log_path(&self.dir, g);
            if from.exists() {
                std::fs::rename(&from, log_path(&self.dir, g + 1))?;
            }
        }
        if keep > 0 {
            std::fs::rename(log_path(&self.dir, 0), log_path(&self.dir, 1))?;
        }
        let file = std::fs::OpenOptions::new().create(true).write(true).truncate(true).open(log_path(&self.dir, 0))?;
        self.out = std::io::BufWriter::new(file);
        self.bytes = 0;
        Ok(())
    }
}

pub struct DecisionLog {
    inner: Mutex<Inner>,
    keep: usize,
}

impl DecisionLog {
    /// Opens the log in `dir` (continuing its numbering), or an in-memory
    /// one; keeps the newest `keep` entries queryable.
    pub fn open(dir: Option<&Path>, keep: usize) -> std::io::Result<DecisionLog> {
        DecisionLog::open_rotating(dir, keep, Rotation::default())
    }

    /// [`DecisionLog::open`] with the file rotated as `rotation` says. A
    /// start reads the current file and, when it holds fewer than `keep`
    /// decisions, the newest rotated one: at most two files' bytes.
    pub fn open_rotating(dir: Option<&Path>, keep: usize, rotation: Rotation) -> std::io::Result<DecisionLog> {
        let mut recent = VecDeque::new();
        let mut next_id = 1;
        let mut max_job_id = 0;
        let file = match dir {
            Some(dir) => {
                let current = read_log(&log_path(dir, 0))?;
                let older = if current.len() < keep && rotation.keep_files > 0 { read_log(&log_path(dir, 1))? } else { Vec::new() };
                for rec in older.into_iter().chain(current) {
                    next_id = next_id.max(rec.id + 1);
                    max_job_id = max_job_id.max(rec.job_id);
                    recent.push_back(rec);
                    if recent.len() > keep {
                        recent.pop_front();
                    }
                }
                let path = log_path(dir, 0);
                let out = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
                let bytes = out.metadata()?.len();
                Some(LogFile { dir: dir.to_path_buf(), out: std::io::BufWriter::new(out), bytes, rotation })
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
            if let Err(e) = f.write(&line) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(job_id: u64) -> DecisionRecord {
        DecisionRecord {
            id: 0,
            unix_ms: 0,
            partition: "p0".into(),
            job_id,
            actor: "t".into(),
            arm: "active".into(),
            actuated: true,
            policy: "x".into(),
            policy_semver: "1.0.0".into(),
            policy_version: 1,
            sha256: String::new(),
            input_digest: String::new(),
            outcome: "placed".into(),
            detail: String::new(),
            placements: Vec::new(),
            latency_us: 1,
        }
    }

    struct Scratch(PathBuf);
    impl Scratch {
        fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn the_log_rotates_by_size_keeps_its_numbering_and_reads_at_most_two_files() {
        let dir = std::env::temp_dir().join(format!("berth-decisions-rotate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let dir = Scratch(dir);
        let rotation = Rotation { max_bytes: 4096, keep_files: 2 };
        let log = DecisionLog::open_rotating(Some(dir.path()), 20, rotation).unwrap();
        for j in 1..=400 {
            log.append(decision(j));
        }
        drop(log);
        let sizes: Vec<u64> = (0..4).map(|g| std::fs::metadata(log_path(dir.path(), g)).map_or(0, |m| m.len())).collect();
        assert!(sizes[0] <= 4096 + 1024 && sizes[1] > 4096 && sizes[2] > 4096, "current and two rotated files: {sizes:?}");
        assert_eq!(sizes[3], 0, "a third rotated file is deleted: {sizes:?}");
        let on_disk: u64 = sizes.iter().sum();
        assert!(on_disk < 4 * 4096 + 4096, "the files stay bounded: {on_disk} bytes");
        // A restart continues the numbering and serves the newest decisions.
        // (20 kept: fewer than one file holds, so the two newest files hold them.)
        let log = DecisionLog::open_rotating(Some(dir.path()), 20, rotation).unwrap();
        assert_eq!(log.max_job_id(), 400);
        let newest = log.query(&Filter { limit: 50, ..Default::default() });
        assert_eq!(newest.len(), 20);
        assert_eq!(newest[0].job_id, 400);
        assert_eq!(log.append(decision(401)), 401, "ids continue past the last logged one");
    }
}
