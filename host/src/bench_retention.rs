//! `berth bench retention`: a long-lived host's footprint. An in-process
//! `berth serve` on a manual clock (the embedded store, or none) runs many
//! short jobs in rounds (submitted over gRPC, placed, run, ended); the
//! retention keeps a bounded number. At each tenth it reports the process's
//! resident memory, the jobs kept, the store file's size and the latency of
//! one `berth jobs` page.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::serve::clock::{Clock, ManualClock};
use crate::proto as pb;
use crate::serve::state::Retention;
use crate::serve::state::Live;
use crate::serve::server::{ServeConfig, StoreChoice, DEFAULT_FLEET};

const TOKEN: &str = "bench-retention-token";

/// Settings of one run.
#[derive(Clone, Debug)]
pub struct RetentionBench {
    pub jobs: u64,
    /// Ended jobs kept per partition.
    pub keep: usize,
    /// Jobs submitted per round (each round runs and ends).
    pub round: u32,
    /// Keep state in the embedded store (false: memory only).
    pub embedded_store: bool,
    pub state_dir: std::path::PathBuf,
    pub policy: String,
}

/// One sample, taken after `jobs` jobs ended.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Sample {
    pub jobs: u64,
    pub elapsed_s: f64,
    pub rss_mib: f64,
    pub kept_jobs: usize,
    pub store_mib: f64,
    pub list_page_ms: f64,
}

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok()).map_or(0.0, |kb| kb / 1024.0)
}

fn settle(live: &Live) -> anyhow::Result<()> {
    anyhow::ensure!(live.wait_settled(0, Duration::from_secs(120)), "partition p0 did not settle in 2 minutes");
    Ok(())
}

pub fn run(b: &RetentionBench, mut report: impl FnMut(&Sample)) -> anyhow::Result<Vec<Sample>> {
    anyhow::ensure!(b.round >= 1 && b.round <= 256, "--round must be 1..=256 (the partition has 256 GPUs)");
    let _ = std::fs::remove_dir_all(&b.state_dir);
    std::fs::create_dir_all(&b.state_dir)?;
    let clock = Arc::new(ManualClock::at(1_700_000_000_000));
    let access = format!("[[identities]]\nname = \"bench\"\ntoken = \"{TOKEN}\"\nroles = {{ \"*\" = \"operator\" }}\n");
    let mut scheduling = crate::serve::server::Scheduling { auto_compaction: false, clock: clock.clone(), ..Default::default() };
    scheduling.retention = Retention { ended_max: b.keep, ..Retention::default() };
    let config = ServeConfig {
        listen: "127.0.0.1:0".parse()?,
        metrics_listen: None,
        inference_listen: None,
        state_dir: b.state_dir.clone(),
        fleet: crate::asi::fleet::FleetConfig::parse(DEFAULT_FLEET, "(embedded default)")?,
        access: crate::serve::auth::Access::parse(&access)?,
        tls: None,
        default_policy: std::fs::read(crate::catalog::resolve(&b.policy)?)?,
        limits: crate::wasm::Limits { deadline: Duration::from_secs(5), ..Default::default() },
        breaker: Default::default(),
        max_upload_bytes: 16 << 20,
        store: if b.embedded_store { StoreChoice::Embedded } else { StoreChoice::Memory },
        scheduling,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let h = rt.block_on(crate::serve::start(config))?;
    let live = h.live.clone();
    let api = rt.block_on(crate::client::connect(&format!("http://{}", h.addr), Some(TOKEN), None, None))?;
    let started = Instant::now();
    let mut samples = Vec::new();
    let every = (b.jobs / 10).max(1);
    let mut done = 0u64;
    let mut next_sample = every;
    while done < b.jobs {
        let n = (b.jobs - done).min(u64::from(b.round));
        live.hold(0, true);
        rt.block_on(async {
            let mut set = tokio::task::JoinSet::new();
            for _ in 0..n {
                let mut api = api.clone();
                set.spawn(async move {
                    let spec = pb::JobSpec { partition: "p0".into(), tasks: 1, gpus: 1, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, duration_s: 1.0, ..Default::default() };
                    api.submit_job(pb::SubmitJobRequest { job: Some(spec), ..Default::default() }).await
                });
            }
            while let Some(r) = set.join_next().await {
                r??;
            }
            anyhow::Ok(())
        })?;
        live.hold(0, false);
        settle(&live)?;
        // They run for a second, end, and the retention round (every 2 s
        // of the clock) takes what is past the bound.
        for step in [1_000, 2_000] {
            clock.set(clock.unix_ms() + step);
            live.hold(0, false);
            settle(&live)?;
        }
        done += n;
        if done >= next_sample || done == b.jobs {
            next_sample += every;
            let kept_jobs = live.partitions[0].lock_state().jobs.len();
            let store_mib = std::fs::metadata(b.state_dir.join("state.redb")).map_or(0.0, |m| m.len() as f64 / (1 << 20) as f64);
            let listed = Instant::now();
            let mut c = api.clone();
            let page = rt.block_on(c.list_jobs(pb::ListJobsRequest { limit: 50, ..Default::default() }))?.into_inner();
            let list_page_ms = listed.elapsed().as_secs_f64() * 1e3;
            anyhow::ensure!(!page.jobs.is_empty(), "berth jobs listed nothing");
            let s = Sample { jobs: done, elapsed_s: started.elapsed().as_secs_f64(), rss_mib: rss_mib(), kept_jobs, store_mib, list_page_ms };
            report(&s);
            samples.push(s);
        }
    }
    drop(api);
    rt.block_on(h.shutdown());
    let _ = std::fs::remove_dir_all(&b.state_dir);
    Ok(samples)
}
