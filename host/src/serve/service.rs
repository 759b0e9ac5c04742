//! The gRPC service: checks who is calling and what they may do, checks the
//! input, and maps between the protobuf messages and the live host.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use berth_core::accounting::{self, PendingShape};
use berth_core::sim::Job;
use berth_core::{predicate, TaskClass, TaskShape};
use tonic::{Request, Response, Status};

use super::auth::{Identity, Role};
use super::bounds;
use super::decisions::{DecisionRecord, Filter, Placed};
use super::error::ServeError;
use super::work::WorkTally;
use super::registry::VersionMeta;
use super::shadow::{self, Mode};
use super::state::{hook_key, IdempotencyKey, JobRecord, JobSpec, JobState, Live, PolicyHook, MAX_IDEMPOTENCY_KEY, SHOWN_STATES};
use crate::proto::{self as pb, berth_server::Berth};

#[derive(Clone)]
pub struct Service {
    pub live: Arc<Live>,
    /// Node agents (`berth agent`), listed by `ListNodes` beside the simulated fleet.
    pub agents: Option<Arc<crate::serve::hub::Hub>>,
}

type Reply<T> = Result<Response<T>, Status>;

/// The longest prefix of `items` whose encoding fits in a reply.
fn fit_reply<T: prost::Message>(items: &mut Vec<T>) {
    let mut total = 0usize;
    let keep = items
        .iter()
        .position(|m| {
            total += m.encoded_len() + 8;
            total > bounds::REPLY_BYTES
        })
        .unwrap_or(items.len());
    items.truncate(keep);
}

/// Most jobs one ListJobs page holds.
const MAX_LIST_JOBS: usize = 10_000;

/// A submission's idempotency key, checked, with the digest of its spec
/// (env in name order: the wire's map order is not the spec's).
fn idempotency_key(r: &pb::SubmitJobRequest) -> Result<Option<IdempotencyKey>, ServeError> {
    let key = &r.idempotency_key;
    if key.is_empty() {
        return Ok(None);
    }
    if key.len() > MAX_IDEMPOTENCY_KEY || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ServeError::Invalid(format!(
            "idempotency key \"{}\" ({} bytes): at most {MAX_IDEMPOTENCY_KEY} printable ASCII bytes, no spaces",
            crate::text::printable(key, 32),
            key.len()
        )));
    }
    use prost::Message;
    use sha2::{Digest, Sha256};
    let mut spec = r.job.clone().unwrap_or_default();
    let mut env: Vec<(String, String)> = std::mem::take(&mut spec.env).into_iter().collect();
    env.sort();
    let mut h = Sha256::new();
    h.update(spec.encode_to_vec());
    for (k, v) in env {
        h.update((k.len() as u64).to_le_bytes());
        h.update(k);
        h.update((v.len() as u64).to_le_bytes());
        h.update(v);
    }
    Ok(Some(IdempotencyKey { key: key.clone(), digest: hex::encode(&h.finalize()[..16]) }))
}

fn policy_ref(m: &VersionMeta) -> pb::PolicyRef {
    pb::PolicyRef { version: m.version, name: m.name.clone(), policy_version: m.semver.clone(), sha256: m.sha256.clone() }
}

fn task_placements(p: &[Placed]) -> Vec<pb::TaskPlacement> {
    p.iter().map(|p| pb::TaskPlacement { node: p.node.clone(), gpus: p.gpus.clone() }).collect()
}

/// Runs blocking work (wasm loads and calls, file writes) off the async
/// workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ServeError> + Send + 'static) -> Result<T, Status> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Status::internal(format!("worker failed: {e}")))?.map_err(Status::from)
}

impl Service {
    fn denied(&self, e: ServeError) -> Status {
        let code = match e {
            ServeError::Unauthenticated(_) => "unauthenticated",
            _ => "permission_denied",
        };
        self.live.metrics.api_denials.with_label_values(&[code]).inc();
        e.into()
    }

    fn who<T>(&self, req: &Request<T>) -> Result<Identity, Status> {
        self.live.access.identify(req).map_err(|e| self.denied(e))
    }

    fn require(&self, id: &Identity, partition: &str, role: Role) -> Result<(), Status> {
        // Permission before existence: a caller without a role there learns
        // nothing about which partitions exist.
        id.require(partition, role).map_err(|e| self.denied(e))?;
        self.live.partition_index(partition)?;
        Ok(())
    }

    /// The partition of `job_id` if the caller may see it. A job in a
    /// partition the caller has no role in is answered exactly as a job that
    /// does not exist, so job ids cannot be probed.
    /// Each run's usage and OOM mark, from the agent hub (one lock for the
    /// page).
    fn with_usage(&self, jobs: &mut [pb::Job]) {
        let Some(hub) = &self.agents else { return };
        let usage = hub.usage_of(jobs.iter().flat_map(|j| j.runs.iter().map(|r| r.allocation_id)));
        for r in jobs.iter_mut().flat_map(|j| j.runs.iter_mut()) {
            if let Some((u, limit)) = usage.get(&r.allocation_id) {
                r.usage = u.clone();
                r.limit = limit.clone();
            }
        }
    }

    fn job_partition(&self, id: &Identity, job_id: u64) -> Result<usize, Status> {
        let hidden = || Status::from(ServeError::UnknownJob(job_id));
        let p = self.live.job_partition(job_id).map_err(|_| hidden())?;
        if !id.can_view(&self.live.partitions[p].name) {
            return Err(hidden());
        }
        Ok(p)
    }

    /// SleepJob and WakeJob: operators of the job's partition.
    fn set_sleep(&self, req: Request<pb::SleepJobRequest>, wake: bool) -> Reply<pb::SleepJobResponse> {
        let id = self.who(&req)?;
        let job_id = req.get_ref().job_id;
        let p = self.job_partition(&id, job_id)?;
        self.require(&id, &self.live.partitions[p].name, Role::Operator)?;
        let now = if wake { self.live.wake_job(p, job_id)? } else { self.live.sleep_job(p, job_id)? };
        tracing::info!(target: "berth::serve", job = job_id, by = %id.name, "{}: now {}", if wake { "wake" } else { "sleep" }, now.as_str());
        let detail = self.live.partitions[p].lock_state().jobs.get(&job_id).map(|j| j.last_decision.clone()).unwrap_or_default();
        Ok(Response::new(pb::SleepJobResponse { sleep: now.as_str().into(), detail }))
    }

    /// Partitions the caller may view: `partition`, or all they can see.
    fn viewable(&self, id: &Identity, partition: &str) -> Result<Vec<usize>, Status> {
        if partition.is_empty() {
            return Ok((0..self.live.partitions.len()).filter(|&p| id.can_view(&self.live.partitions[p].name)).collect());
        }
        self.require(id, partition, Role::Viewer)?;
        Ok(vec![self.live.partition_index(partition)?])
    }

    /// The tiers `id` may buy in `partition`: every tier for its
    /// operators, the access file's tenant tiers for everyone else.
    fn buyable_tiers(&self, id: &Identity, partition: &str) -> Vec<berth_core::Tier> {
        if id.role_in(partition) >= Some(Role::Operator) {
            berth_core::Tier::ALL.to_vec()
        } else {
            self.live.access.tenant_tiers(partition)
        }
    }

    fn job_spec(&self, id: &Identity, spec: Option<pb::JobSpec>) -> Result<JobSpec, ServeError> {
        let s = spec.ok_or_else(|| ServeError::Invalid("job is missing".into()))?;
        let p = self.live.partition_index(&s.partition)?;
        let bad = |m: String| ServeError::Invalid(m);
        check_job_size(&s)?;
        if id.role_in(&s.partition) < Some(Role::Operator) {
            let ceiling = self.live.access.priority_ceiling(&s.partition).unwrap_or(bounds::TENANT_PRIORITY);
            if s.priority > ceiling {
                return Err(bad(format!("priority {}: a tenant of partition {} may give at most {ceiling}", s.priority, s.partition)));
            }
        }
        let tasks = s.tasks.max(1);
        if tasks > 4096 {
            return Err(bad(format!("{tasks} tasks: at most 4096")));
        }
        // A job with argv runs until its processes exit; duration_s is then
        // an optional limit.
        let least = if s.argv.is_empty() { f64::MIN_POSITIVE } else { 0.0 };
        if !(s.duration_s.is_finite() && s.duration_s >= least && s.duration_s <= 30.0 * 86_400.0) {
            let range = if s.argv.is_empty() { "(0, 30 days]" } else { "[0, 30 days] (0: no limit)" };
            return Err(bad(format!("duration_s {} must be in {range}", s.duration_s)));
        }
        if s.argv.first().is_some_and(|a| a.is_empty()) {
            return Err(bad("argv[0] is empty".into()));
        }
        if let Some(k) = s.env.keys().find(|k| k.is_empty() || k.contains('=') || k.contains('\0')) {
            return Err(bad(format!("env name \"{}\" is empty or contains '=' or NUL", crate::text::printable(k, 64))));
        }
        super::work::check_unit(&s.work_unit).map_err(bad)?;
        let gpu_milli = if s.gpus > 0 && s.gpu_milli == 0 { 1000 } else { s.gpu_milli };
        // Models of the partition's fleet, agent nodes included.
        let known = self.live.partitions[p].models.lock().unwrap().clone();
        let models = s
            .models
            .iter()
            .map(|m| {
                known.iter().position(|k| k == m).map(|i| i as u32).ok_or_else(|| {
                    bad(format!("unknown GPU model \"{}\" (partition {} has {known:?})", crate::text::printable(m, 64), s.partition))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let shape = TaskShape { gpu_count: s.gpus, gpu_milli, cpu_milli: s.cpu_milli, memory_mib: s.memory_mib, models };
        shape.check().map_err(|e| bad(format!("task shape: {e}")))?;
        let declared_class = match s.class.as_str() {
            "" => None,
            name => Some(TaskClass::from_name(name).ok_or_else(|| {
                bad(format!("class \"{}\": one of training, inference, cpu-only", crate::text::printable(name, 32)))
            })?),
        };
        if declared_class == Some(TaskClass::CpuOnly) && shape.gpu_count > 0 {
            return Err(bad(format!("class cpu-only with {} GPUs per task: a cpu-only job asks for no GPU", shape.gpu_count)));
        }
        if declared_class.is_some_and(|c| c != TaskClass::CpuOnly) && shape.gpu_count == 0 {
            return Err(bad(format!("class {} without GPUs: a job without GPUs is cpu-only", s.class)));
        }
        let tier = match s.tier.as_str() {
            "" => self.live.access.default_tier(&s.partition),
            name => berth_core::Tier::from_name(name).ok_or_else(|| {
                bad(format!("tier \"{}\": one of guaranteed, preemptible, opportunistic", crate::text::printable(name, 32)))
            })?,
        };
        let may = self.buyable_tiers(id, &s.partition);
        if !may.contains(&tier) {
            let names: Vec<&str> = may.iter().map(|t| t.name()).collect();
            return Err(ServeError::PermissionDenied(format!("tier {}: a tenant of partition {} may buy {names:?}", tier.name(), s.partition)));
        }
        // The partition's contract, as this tier has it.
        let contract = Some(self.live.contract.of_tier(tier));
        if !(s.budget_gpu_h.is_finite() && (0.0..=bounds::MAX_BUDGET_GPU_H).contains(&s.budget_gpu_h)) {
            return Err(bad(format!("budget_gpu_h {} must be in [0, {}] (0: no bound)", s.budget_gpu_h, bounds::MAX_BUDGET_GPU_H)));
        }
        if s.budget_gpu_h > 0.0 && (tier != berth_core::Tier::Opportunistic || shape.gpu_count == 0) {
            return Err(bad(format!("budget_gpu_h {}: only opportunistic jobs with GPUs buy a GPU-hour budget (this one is {} with {} GPUs per task)", s.budget_gpu_h, tier.name(), shape.gpu_count)));
        }
        let budget_gpu_s = (s.budget_gpu_h * 3600.0).ceil() as u64;
        Ok(JobSpec {
            partition: s.partition.clone(),
            name: s.name.clone(),
            models: s.models.clone(),
            duration: Duration::from_secs_f64(s.duration_s),
            argv: s.argv.clone(),
            env: s.env.clone().into_iter().collect(),
            movable: s.movable && !s.argv.is_empty(),
            wait_ready: s.wait_ready,
            sleepable: s.sleepable,
            work_unit: s.work_unit.clone(),
            budget_gpu_s,
            job: Job { priority: s.priority, duration_s: s.duration_s.ceil() as u64, tasks, shape, declared_class, contract, ..Job::default() },
        })
    }
}

/// Size bounds of a job spec, each error naming its field.
fn check_job_size(s: &pb::JobSpec) -> Result<(), ServeError> {
    let bad = |m: String| Err(ServeError::Invalid(m));
    if s.name.len() > bounds::JOB_NAME_BYTES {
        return bad(format!("job.name is {} bytes: at most {}", s.name.len(), bounds::JOB_NAME_BYTES));
    }
    if s.argv.len() > bounds::ARGV {
        return bad(format!("job.argv has {} arguments: at most {}", s.argv.len(), bounds::ARGV));
    }
    if s.env.len() > bounds::ENV {
        return bad(format!("job.env has {} variables: at most {}", s.env.len(), bounds::ENV));
    }
    if s.models.len() > bounds::MODELS {
        return bad(format!("job.models has {} entries: at most {}", s.models.len(), bounds::MODELS));
    }
    let total = s.name.len()
        + s.argv.iter().map(|a| a.len() + 1).sum::<usize>()
        + s.env.iter().map(|(k, v)| k.len() + v.len() + 2).sum::<usize>()
        + s.models.iter().map(|m| m.len() + 1).sum::<usize>()
        + s.partition.len();
    if total > bounds::JOB_SPEC_BYTES {
        return bad(format!("job spec (name, argv, env, models) is {total} bytes: at most {}", bounds::JOB_SPEC_BYTES));
    }
    Ok(())
}

/// A job as a reply. Its environment and arguments (either may hold
/// secrets) only for its owner and the partition's operators; other viewers
/// see the program's name alone.
fn job_message(id: u64, j: &JobRecord, show_env: bool, now_ms: u64) -> pb::Job {
    let s = &j.spec;
    pb::Job {
        id,
        spec: Some(pb::JobSpec {
            partition: s.partition.clone(),
            name: s.name.clone(),
            tasks: s.job.tasks,
            gpus: s.job.shape.gpu_count,
            gpu_milli: s.job.shape.gpu_milli,
            cpu_milli: s.job.shape.cpu_milli,
            memory_mib: s.job.shape.memory_mib,
            models: s.models.clone(),
            priority: s.job.priority,
            duration_s: s.duration.as_secs_f64(),
            argv: if show_env { s.argv.clone() } else { s.argv.first().cloned().into_iter().collect() },
            env: if show_env { s.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect() } else { Default::default() },
            movable: s.movable,
            wait_ready: s.wait_ready,
            sleepable: s.sleepable,
            work_unit: s.work_unit.clone(),
            class: s.job.task_class().name().to_string(),
            tier: s.job.contract.map(|c| c.tier).unwrap_or_default().name().to_string(),
            budget_gpu_h: s.budget_gpu_s as f64 / 3600.0,
        }),
        owner: j.owner.clone(),
        state: j.shown_state().into(),
        submitted_unix_ms: j.submitted_unix_ms,
        started_unix_ms: j.started_unix_ms,
        ended_unix_ms: j.ended_unix_ms,
        placements: task_placements(&j.placements),
        decision_id: j.decision_id,
        policy_version: j.policy_version,
        runs: j
            .runs
            .iter()
            .map(|r| pb::TaskRun {
                allocation_id: r.alloc_id,
                node: r.node.clone(),
                gpus: r.gpus.clone(),
                state: r.state.as_str().into(),
                exit_code: r.exit_code,
                signal: r.signal,
                replaces: r.replaces,
                checkpointed_unix_ms: r.checkpointed_unix_ms,
                work_units: r.work_units,
                work_checkpointed: r.work_checkpointed,
                ..Default::default()
            })
            .collect(),
        detail: j.detail.clone(),
        sleep: j.sleep.as_str().into(),
        work_done: j.work.done,
        work_lost: j.work.lost,
        charged_gpu_h: j.charged_gpu_ms_at(now_ms) as f64 / 3_600_000.0,
    }
}

/// One line on what a task used against what it asked for.
fn task_usage_line(alloc: u64, node: &str, cpu_milli: u32, memory_mib: u64, u: Option<&pb::TaskUsage>, limit: &str) -> String {
    let mut line = format!("task {alloc} on {node}");
    match u {
        Some(u) => {
            line += &format!(
                ": CPU {:.2} of {:.2} cores now, {:.1} s in all, held back {:.1} s by its quota ({} periods); memory {} MiB, peak {} of {} MiB",
                f64::from(u.cpu_milli) / 1000.0,
                f64::from(cpu_milli) / 1000.0,
                u.cpu_ms as f64 / 1000.0,
                u.throttled_ms as f64 / 1000.0,
                u.nr_throttled,
                u.memory_mib,
                u.memory_peak_mib,
                memory_mib
            );
        }
        None => line += ": no usage reported (its agent has no cgroups)",
    }
    if limit == "oom" {
        line += "; killed by the kernel over its memory limit";
    }
    line
}

fn decision_message(d: DecisionRecord) -> pb::Decision {
    pb::Decision {
        id: d.id,
        unix_ms: d.unix_ms,
        partition: d.partition,
        job_id: d.job_id,
        actor: d.actor,
        arm: d.arm,
        actuated: d.actuated,
        policy: d.policy,
        policy_semver: d.policy_semver,
        policy_version: d.policy_version,
        sha256: d.sha256,
        input_digest: d.input_digest,
        outcome: d.outcome,
        detail: d.detail,
        placements: task_placements(&d.placements),
        latency_us: d.latency_us,
    }
}

fn denominators(d: &accounting::Denominators) -> pb::Denominators {
    pb::Denominators {
        installed: d.installed,
        powered: d.powered,
        healthy: d.healthy,
        schedulable: d.schedulable,
        busy: d.busy,
        productive: d.productive,
        reclaimable: d.reclaimable,
    }
}

#[tonic::async_trait]
impl Berth for Service {
    type ExportCaptureStream = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::CaptureChunk, Status>> + Send>>;

    async fn export_capture(&self, req: Request<pb::ExportCaptureRequest>) -> Reply<Self::ExportCaptureStream> {
        let id = self.who(&req)?;
        let r = req.into_inner();
        self.require(&id, &r.partition, Role::Operator)?;
        let p = self.live.partition_index(&r.partition)?;
        let live = self.live.clone();
        // Written out first (the lock takes what the engine recorded).
        let dir = blocking(move || {
            Ok(live.partitions[p].lock_state().capture.as_mut().map(|c| {
                c.sync();
                c.dir().to_path_buf()
            }))
        })
        .await?;
        let Some(dir) = dir else { return Err(Status::failed_precondition(format!("partition {}: capture is off (berth serve --capture-mib 0)", r.partition))) };
        let window = crate::capture::Window { since: r.since_s, until: r.until_s };
        tracing::info!(target: "berth::serve", partition = %r.partition, by = %id.name, since = ?r.since_s, until = ?r.until_s, "capture exported");
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::task::spawn_blocking(move || {
            // Whole lines, about a MiB a message.
            let mut chunk = Vec::new();
            let sent = crate::capture::export(&dir, window, |line| {
                chunk.extend_from_slice(line.as_bytes());
                chunk.push(b'\n');
                if chunk.len() >= 1 << 20 {
                    tx.blocking_send(Ok(pb::CaptureChunk { text: std::mem::take(&mut chunk) })).map_err(|_| std::io::Error::other("the caller left"))?;
                }
                Ok(())
            });
            let last = match sent {
                Ok(_) => Ok(pb::CaptureChunk { text: chunk }),
                Err(e) => Err(Status::internal(format!("reading the capture in {}: {e}", dir.display()))),
            };
            let _ = tx.blocking_send(last);
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn submit_job(&self, req: Request<pb::SubmitJobRequest>) -> Reply<pb::SubmitJobResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let partition = req.get_ref().job.as_ref().map(|j| j.partition.clone()).unwrap_or_default();
            this.require(&id, &partition, Role::Tenant)?;
            let r = req.into_inner();
            let idempotency = idempotency_key(&r)?;
            let spec = this.job_spec(&id, r.job)?;
            let (job_id, duplicate) = this.live.submit(spec, &id.name, idempotency)?;
            if duplicate {
                tracing::info!(target: "berth::serve", job = job_id, partition, owner = %id.name, "submission retried: the job its idempotency key made");
            } else {
                tracing::info!(target: "berth::serve", job = job_id, partition, owner = %id.name, "job submitted");
            }
            Ok(Response::new(pb::SubmitJobResponse { job_id, duplicate }))
        }).await
    }

    async fn cancel_job(&self, req: Request<pb::CancelJobRequest>) -> Reply<pb::CancelJobResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let job_id = req.get_ref().job_id;
            let p = this.job_partition(&id, job_id)?;
            let partition = this.live.partitions[p].name.clone();
            this.require(&id, &partition, Role::Tenant)?;
            let owner = this.live.partitions[p].lock_state().jobs.get(&job_id).map(|j| j.owner.clone()).unwrap_or_default();
            if owner != id.name && id.role_in(&partition) < Some(Role::Operator) {
                tracing::warn!(target: "berth::serve::auth", identity = %id.name, job = job_id, "denied: cancel of another tenant's job");
                return Err(this.denied(ServeError::PermissionDenied(format!("job {job_id} belongs to {owner}; {} may cancel only its own jobs", id.name))));
            }
            let before = this.live.cancel(p, job_id)?;
            tracing::info!(target: "berth::serve", job = job_id, by = %id.name, "job cancelled");
            Ok(Response::new(pb::CancelJobResponse { previous_state: before.as_str().into() }))
        }).await
    }

    async fn migrate_task(&self, req: Request<pb::MigrateTaskRequest>) -> Reply<pb::MigrateTaskResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let r = req.into_inner();
            let unknown = || Status::not_found(format!("no task allocation {}", r.allocation_id));
            let partition = this.live.allocation_partition(r.allocation_id).ok_or_else(unknown)?;
            // As for jobs: no role there reads as no such allocation.
            if !id.can_view(&partition) {
                return Err(unknown());
            }
            this.require(&id, &partition, Role::Operator)?;
            let m = this.live.migrate(r.allocation_id, &r.node, r.checkpoint)?;
            tracing::info!(target: "berth::serve", job = m.job_id, from = r.allocation_id, to = m.alloc_id, node = %m.node, by = %id.name, "task migration started");
            Ok(Response::new(pb::MigrateTaskResponse { job_id: m.job_id, allocation_id: m.alloc_id, node: m.node, gpus: m.gpus }))
        }).await
    }

    async fn sleep_job(&self, req: Request<pb::SleepJobRequest>) -> Reply<pb::SleepJobResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            this.set_sleep(req, false)
        }).await
    }

    async fn wake_job(&self, req: Request<pb::SleepJobRequest>) -> Reply<pb::SleepJobResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            this.set_sleep(req, true)
        }).await
    }

    async fn list_jobs(&self, req: Request<pb::ListJobsRequest>) -> Reply<pb::ListJobsResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let r = req.into_inner();
            let limit = if r.limit == 0 { 1000 } else { (r.limit as usize).min(MAX_LIST_JOBS) };
            if !r.state.is_empty() && !SHOWN_STATES.contains(&r.state.as_str()) {
                return Err(ServeError::Invalid(format!("unknown state \"{}\" ({})", crate::text::printable(&r.state, 32), SHOWN_STATES.join(", "))).into());
            }
            let before = if r.before_id == 0 { u64::MAX } else { r.before_id };
            // Each partition reads newest first from its id-ordered table and
            // stops at the page's length: a page costs its length, not the
            // number of jobs kept.
            let mut jobs = Vec::new();
            let mut more = false;
            for p in this.viewable(&id, &r.partition)? {
                let st = this.live.partitions[p].lock_state();
                let operator = id.role_in(&this.live.partitions[p].name) >= Some(Role::Operator);
                let page: Vec<pb::Job> = st
                    .jobs
                    .range(..before)
                    .rev()
                    .filter(|(_, j)| r.state.is_empty() || j.shown_state() == r.state)
                    .take(limit)
                    .map(|(&i, j)| job_message(i, j, operator || j.owner == id.name, st.clock.unix_ms()))
                    .collect();
                more |= page.len() == limit;
                jobs.extend(page);
            }
            jobs.sort_by_key(|j| std::cmp::Reverse(j.id));
            more |= jobs.len() > limit;
            this.with_usage(&mut jobs);
            jobs.truncate(limit);
            let gathered = jobs.len();
            fit_reply(&mut jobs);
            more |= jobs.len() < gathered;
            let next_before_id = if more { jobs.last().map_or(0, |j| j.id) } else { 0 };
            Ok(Response::new(pb::ListJobsResponse { jobs, next_before_id }))
        }).await
    }

    async fn explain_job(&self, req: Request<pb::ExplainJobRequest>) -> Reply<pb::ExplainJobResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let job_id = req.get_ref().job_id;
            let p = this.job_partition(&id, job_id)?;
            let part = &this.live.partitions[p];
            this.require(&id, &part.name, Role::Viewer)?;
            let st = part.lock_state();
            // Pruned since it was found: gone, as for any unknown job.
            let job = st.jobs.get(&job_id).ok_or(ServeError::UnknownJob(job_id))?;
            let mut out = pb::ExplainJobResponse { state: job.shown_state().into(), last_decision: job.last_decision.clone(), ..Default::default() };
            if job.state != JobState::Pending {
                out.summary = match job.state {
                    JobState::Running => format!(
                        "running on {}",
                        job.placements.iter().map(|p| format!("{} GPUs {:?}", p.node, p.gpus)).collect::<Vec<_>>().join(", ")
                    ),
                    s if job.detail.is_empty() => s.as_str().to_string(),
                    s => format!("{}: {}", s.as_str(), job.detail),
                };
                // The latest run's tasks: what each used against what it
                // asked for.
                if let Some(hub) = &this.agents {
                    let usage = hub.usage_of(job.runs.iter().map(|r| r.alloc_id));
                    let shape = &job.spec.job.shape;
                    for r in &job.runs {
                        if let Some((u, limit)) = usage.get(&r.alloc_id) {
                            out.tasks.push(task_usage_line(r.alloc_id, &r.node, shape.cpu_milli, shape.memory_mib, u.as_ref(), limit));
                        }
                    }
                }
                return Ok(Response::new(out));
            }
            let shape = &job.spec.job.shape;
            // Where it may run, as the engine decides: jobs with a command on
            // agent nodes only (simulated ones never), and a high-priority job
            // not on nodes with GPUs lent by a sleeping job.
            let agent_job = !job.spec.argv.is_empty();
            let high = job.spec.job.priority >= st.engine.config.high_priority;
            let lent = st.engine.lent();
            let may_run = |id: u32| st.agent(id) == agent_job && !(high && lent.contains_key(&id));
            let mut reasons: BTreeMap<berth_core::Unfit, u32> = BTreeMap::new();
            let mut lent_nodes = 0;
            for (id, node) in st.fleet.nodes().iter().enumerate() {
                let id = id as u32;
                if st.agent(id) != agent_job {
                    continue;
                }
                if !may_run(id) {
                    lent_nodes += 1;
                    continue;
                }
                match predicate::check(node, shape) {
                    Ok(()) => out.fitting_nodes += 1,
                    Err(why) => *reasons.entry(why).or_insert(0) += 1,
                }
            }
            out.fitting_tasks = berth_core::sim::fitting_tasks_among(&st.fleet, shape, u32::MAX, &|id, _| may_run(id));
            let candidates = st.fleet.nodes().iter().enumerate().filter(|(id, _)| st.agent(*id as u32) == agent_job).count();
            let mut ranked: Vec<(berth_core::Unfit, u32)> = reasons.into_iter().collect();
            ranked.sort_by_key(|&(why, n)| (std::cmp::Reverse(n), why));
            out.reasons = ranked.iter().map(|(why, n)| pb::UnfitCount { reason: why.to_string(), nodes: *n }).collect();
            let me = (std::cmp::Reverse(job.spec.job.priority), job_id);
            out.queue_position = st.pending.iter().filter(|j| (std::cmp::Reverse(st.jobs[j].spec.job.priority), **j) < me).count() as u32;
            let mut reasons_text =
                ranked.iter().enumerate().map(|(i, (why, n))| if i == 0 { format!("{n} nodes: {why}") } else { format!("{n}: {why}") }).collect::<Vec<_>>().join("; ");
            if lent_nodes > 0 {
                let lent_text = format!("{lent_nodes} nodes: GPUs lent by a sleeping job (for low-priority work only)");
                reasons_text = if reasons_text.is_empty() { lent_text } else { format!("{lent_text}; {reasons_text}") };
            }
            let tasks = job.spec.job.tasks;
            // The guard's reservation, if this job holds it.
            let reserved = st.slots.get(&job_id).and_then(|&slot| st.engine.reservation(None).filter(|&(s, _)| s == slot)).map(|(_, until)| until);
            out.reserved_until_unix_s = reserved.unwrap_or(0);
            out.summary = if st.paused {
                "decisions paused: the circuit breaker found no good policy version; an operator must activate one".into()
            } else if candidates == 0 {
                if agent_job { "no agent node in the partition: a job with a command runs on agent nodes" } else { "no simulated node in the partition: a job without a command runs on simulated nodes" }.into()
            } else if out.fitting_tasks >= tasks {
                format!("fits now ({} of {candidates} nodes); {} job(s) ahead in the queue", out.fitting_nodes, out.queue_position)
            } else if tasks > 1 && out.fitting_nodes > 0 {
                format!("gang of {tasks} tasks, {} fit now; {reasons_text}", out.fitting_tasks)
            } else {
                reasons_text
            };
            let now = st.now_s();
            if let Some(&slot) = st.slots.get(&job_id)
                && let Some((at, recent, at_limit)) = st.engine.held_back(slot, now)
            {
                let wait = at.saturating_sub(now);
                out.summary = if at_limit {
                    format!(
                        "preempted {recent} times in 24 h, its contract's limit: starts again in {wait} s at the earliest, so that all running low-priority work stays preemptible; {}",
                        out.summary
                    )
                } else {
                    format!("preempted: vacating, may start again in {wait} s; {}", out.summary)
                };
            }
            if let Some(&slot) = st.slots.get(&job_id)
                && let Some((behind, ends)) = st.engine.held_by_window(slot)
            {
                let wait = ends.saturating_sub(now);
                out.summary = format!(
                    "held by the admission window: the smaller work admitted ahead of waiting job {behind} this window used its budget; tried again in {wait} s; {}",
                    out.summary
                );
            }
            if req.get_ref().what_if
                && let Some(&slot) = st.slots.get(&job_id)
            {
                // A task's move copies what live compaction estimates for it:
                // its GPU state and its memory, under the partition's config.
                let config = &st.compaction.config;
                let movable = |j: &berth_core::Job| {
                    st.jobs.get(&j.id).filter(|r| r.spec.movable).map(|_| berth_core::compaction::estimate_state_bytes(config, j.shape.gpu_count, j.shape.gpu_milli, j.shape.memory_mib))
                };
                let name = |id: u32| st.fleet.nodes()[id as usize].name.clone();
                for change in st.engine.what_if(&st.fleet, slot, now, &|id, _| may_run(id), &movable) {
                    out.what_if.push(match change {
                        berth_core::whatif::Change::Preempt { jobs, lost_gpu_s } => pb::WhatIf { kind: "preempt".into(), jobs, lost_gpu_seconds: lost_gpu_s, ..Default::default() },
                        berth_core::whatif::Change::Move { moves, bytes } => {
                            let mut jobs: Vec<u64> = moves.iter().map(|m| m.0).collect();
                            jobs.sort_unstable();
                            jobs.dedup();
                            let moves = moves.iter().map(|&(j, from, to)| format!("{j}: {} -> {}", name(from), name(to))).collect();
                            pb::WhatIf { kind: "move".into(), jobs, moves, bytes_moved: bytes, ..Default::default() }
                        }
                        berth_core::whatif::Change::Repair { nodes } => pb::WhatIf { kind: "repair".into(), nodes: nodes.into_iter().map(name).collect(), ..Default::default() },
                    });
                }
            }
            if let Some(until) = reserved {
                out.summary = if until == u64::MAX {
                    format!("reserved by the starvation guard; no running work ends on plan to make room; {}", out.summary)
                } else {
                    let wait = until.saturating_sub(this.live.now_s());
                    format!("reserved by the starvation guard: starts within {wait} s at the latest (nodes drained for it); {}", out.summary)
                };
            }
            Ok(Response::new(out))
        }).await
    }

    async fn list_nodes(&self, req: Request<pb::ListNodesRequest>) -> Reply<pb::ListNodesResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let mut nodes = Vec::new();
            // Agent nodes are in the fleet; the hub knows their reachability and health.
            let agents = this.agents.as_ref().map(|h| h.node_states()).unwrap_or_default();
            for p in this.viewable(&id, &req.get_ref().partition)? {
                let part = &this.live.partitions[p];
                let st = part.lock_state();
                nodes.extend(st.fleet.nodes().iter().map(|n| {
                    let agent = st.agent_ids.contains_key(&n.name).then(|| agents.get(&n.name).cloned().unwrap_or_default());
                    pb::NodeInfo {
                    name: n.name.clone(),
                    partition: part.name.clone(),
                    model: n.model.map_or_else(|| "cpu-only".into(), |m| st.fleet.models[m as usize].clone()),
                    switch_domain: n.switch_domain,
                    schedulable: n.schedulable,
                    gpus: n.gpus.len() as u32,
                    gpus_idle: n.gpus.iter().filter(|&&g| g == berth_core::MILLI_PER_GPU).count() as u32,
                    gpu_free_milli: n.gpu_free_milli(),
                    cpu_free_milli: n.cpu_free_milli,
                    cpu_total_milli: n.cpu_total_milli,
                    memory_free_mib: n.memory_free_mib,
                    memory_total_mib: n.memory_total_mib,
                    source: if agent.is_some() { "agent" } else { "simulated" }.into(),
                    gpus_unhealthy: agent.as_ref().map_or(0, |a| a.1),
                    state: agent.map(|a| a.0).unwrap_or_default(),
                }}));
            }
            Ok(Response::new(pb::ListNodesResponse { nodes }))
        }).await
    }

    async fn list_partitions(&self, req: Request<pb::ListPartitionsRequest>) -> Reply<pb::ListPartitionsResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let mut partitions = Vec::new();
            for p in this.viewable(&id, "")? {
                let part = &this.live.partitions[p];
                let candidate = part.candidate();
                let st = part.lock_state();
                let running = st.jobs.values().filter(|j| j.state == JobState::Running).count() as u32;
                partitions.push(pb::PartitionInfo {
                    name: part.name.clone(),
                    nodes: st.fleet.nodes().len() as u32,
                    gpus: (st.fleet.gpu_total_milli() / 1000) as u32,
                    gpus_busy: st.fleet.gpu_allocated_milli() as f64 / 1000.0,
                    pending_jobs: st.pending.len() as u32,
                    running_jobs: running,
                    active: part.active().map(|a| policy_ref(&a.meta)),
                    shadow_mode: match candidate.as_ref().map(|c| c.mode) {
                        None => "off".into(),
                        Some(Mode::Shadow) => "shadow".into(),
                        Some(Mode::Split(_)) => "split".into(),
                    },
                    candidate: candidate.as_ref().map(|c| policy_ref(&c.arm.meta)),
                    split_fraction: match candidate.as_ref().map(|c| c.mode) {
                        Some(Mode::Split(f)) => f,
                        _ => 0.0,
                    },
                    paused: st.paused,
                    guard: super::guard::describe(st.engine.config.guards.fleet),
                });
            }
            Ok(Response::new(pb::ListPartitionsResponse { partitions }))
        }).await
    }

    async fn credits(&self, req: Request<pb::CreditsRequest>) -> Reply<pb::CreditsResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let r = req.get_ref();
            if r.tenant.len() > 256 {
                return Err(Status::invalid_argument(format!("tenant is {} bytes: at most 256", r.tenant.len())));
            }
            let mut rows = Vec::new();
            for p in this.viewable(&id, &r.partition)? {
                let part = &this.live.partitions[p];
                // A tenant's account is its own business: operators see
                // every tenant's, others only theirs.
                let sees_all = id.role_in(&part.name) >= Some(Role::Operator);
                let st = part.lock_state();
                for (tenant, c) in &st.credits.tenants {
                    if (!r.tenant.is_empty() && *tenant != r.tenant) || (!sees_all && *tenant != id.name) {
                        continue;
                    }
                    rows.push(pb::CreditRow {
                        partition: part.name.clone(),
                        tenant: tenant.clone(),
                        preemptions: c.preemptions,
                        lost_gpu_seconds: c.lost_gpu_s,
                        broken_promises: c.broken_promises,
                        credit_gpu_hours: c.credit_gpu_h,
                    });
                }
            }
            Ok(Response::new(pb::CreditsResponse { rows }))
        }).await
    }

    async fn accounting(&self, req: Request<pb::AccountingRequest>) -> Reply<pb::AccountingResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let mut total = accounting::Accounting::default();
            let mut rows = Vec::new();
            let now_ms = this.live.now_ms();
            let costs = &this.live.cost_per_gpu_hour;
            // Outcome: per group and unit, over the partitions viewed.
            let (mut hours, mut cost) = (0.0, Some(0.0));
            let mut outcome_rows = Vec::new();
            let mut by_total: BTreeMap<String, WorkTally> = BTreeMap::new();
            let mut by_tenant: BTreeMap<(String, String), WorkTally> = BTreeMap::new();
            let mut by_class: BTreeMap<(String, String), WorkTally> = BTreeMap::new();
            for p in this.viewable(&id, &req.get_ref().partition)? {
                let part = &this.live.partitions[p];
                let st = part.lock_state();
                let pending: Vec<PendingShape> = st
                    .pending
                    .iter()
                    .map(|j| &st.jobs[j].spec.job)
                    .map(|j| PendingShape { shape: j.shape.clone(), tasks: j.tasks, same_domain: false })
                    .collect();
                let partition_of = vec![0; st.fleet.nodes().len()];
                let reclaimable = st.engine.reclaimable_milli(&st.fleet);
                // Simulated work always advances (productive = busy); on agent
                // nodes productive is what telemetry measured busy.
                let mut acc = accounting::account(&st.fleet, &pending, &partition_of, &|i, n| accounting::NodeFacts {
                    powered: !st.outcome.powered_down.contains(&(i as berth_core::NodeId)),
                    productive_milli: st.productive_milli(i, n),
                    reclaimable_milli: reclaimable[i],
                });
                // Unhealthy agent GPUs are held out by allocations: not healthy, not busy.
                for (model, (healthy, busy)) in st.held_unhealthy() {
                    for d in [Some(&mut acc.total), acc.by_model.get_mut(&model)].into_iter().flatten() {
                        d.healthy -= healthy;
                        d.busy -= busy;
                    }
                }
                rows.push(pb::AccountingRow { group: format!("partition {}", part.name), gpus: Some(denominators(&acc.total)) });
                total.total.add(&acc.total);
                for (model, d) in &acc.by_model {
                    total.by_model.entry(model.clone()).or_default().add(d);
                }
                for (cause, g) in &acc.stranded {
                    *total.stranded.entry(*cause).or_insert(0.0) += g;
                }
                let (h, c) = super::outcome::installed(&st, now_ms, costs);
                hours += h;
                cost = cost.zip(c).map(|(a, b)| a + b);
                let work = super::outcome::work_by_key(&st);
                let mut by_unit: BTreeMap<String, WorkTally> = BTreeMap::new();
                for ((tenant, class, unit), w) in &work {
                    by_unit.entry(unit.clone()).or_default().add(w);
                    by_tenant.entry((tenant.clone(), unit.clone())).or_default().add(w);
                    by_class.entry((class.clone(), unit.clone())).or_default().add(w);
                }
                for (unit, w) in by_unit {
                    outcome_rows.push(super::outcome::row(format!("partition {}", part.name), &unit, &w, h, c));
                    by_total.entry(unit).or_default().add(&w);
                }
            }
            let cost = cost.filter(|_| !costs.is_empty());
            let mut outcome: Vec<pb::OutcomeRow> = by_total.iter().map(|(unit, w)| super::outcome::row("total".into(), unit, w, hours, cost)).collect();
            outcome.append(&mut outcome_rows);
            outcome.extend(by_tenant.iter().map(|((t, unit), w)| super::outcome::row(format!("tenant {t}"), unit, w, hours, cost)));
            outcome.extend(by_class.iter().map(|((c, unit), w)| super::outcome::row(format!("class {c}"), unit, w, hours, cost)));
            rows.insert(0, pb::AccountingRow { group: "total".into(), gpus: Some(denominators(&total.total)) });
            rows.extend(total.by_model.iter().map(|(m, d)| pb::AccountingRow { group: format!("model {m}"), gpus: Some(denominators(d)) }));
            let stranded = total.stranded.iter().map(|(c, g)| pb::StrandedRow { cause: format!("{c:?}"), gpus: *g }).collect();
            Ok(Response::new(pb::AccountingResponse { rows, stranded, outcome }))
        }).await
    }

    async fn set_guard(&self, req: Request<pb::SetGuardRequest>) -> Reply<pb::SetGuardResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let r = req.into_inner();
            this.require(&id, &r.partition, Role::Operator)?;
            let p = this.live.partition_index(&r.partition)?;
            let guard = super::guard::requested(r.off, r.reserve_after_s, r.aging_per_hour, r.window_s, r.window_gpu_hours)?;
            this.live.set_guard(p, guard)?;
            let text = super::guard::describe(guard);
            tracing::info!(target: "berth::serve", partition = %r.partition, by = %id.name, guard = %text, "starvation guard set");
            Ok(Response::new(pb::SetGuardResponse { guard: text }))
        }).await
    }

    async fn compact_live(&self, req: Request<pb::CompactLiveRequest>) -> Reply<pb::CompactLiveResponse> {
        let id = self.who(&req)?;
        let r = req.into_inner();
        self.require(&id, &r.partition, Role::Operator)?;
        let live = self.live.clone();
        let by = id.name.clone();
        let partition = r.partition.clone();
        let step = blocking(move || live.compact_live(&by, &partition, r.dry_run)).await?;
        tracing::info!(target: "berth::serve", partition = %r.partition, by = %id.name, dry_run = r.dry_run, chains = ?step.chain_ids, "live compaction step");
        Ok(Response::new(pb::CompactLiveResponse {
            policy: step.policy,
            rejected: step.rejected.unwrap_or_default(),
            chains: step
                .chains
                .iter()
                .map(|c| pb::ChainPlan {
                    chain: c.chain,
                    moves: c.moves as u32,
                    nodes_freed: c.nodes_freed,
                    benefit_gpu_s: c.benefit_gpu_s,
                    cost_gpu_s: c.cost_gpu_s,
                    run: c.run,
                    skipped: c.skipped.clone().unwrap_or_default(),
                })
                .collect(),
            moves: step
                .moves
                .iter()
                .map(|(m, job, alloc, from, to, gpus)| pb::MovePlan {
                    chain: m.chain,
                    job_id: *job,
                    allocation_id: *alloc,
                    from_node: from.clone(),
                    to_node: to.clone(),
                    to_gpus: gpus.clone(),
                    tier: super::compacting::tier_name(m.tier).into(),
                    state_bytes: m.state_bytes,
                })
                .collect(),
            chain_ids: step.chain_ids,
            idle_nodes: step.idle_nodes as u32,
            partial_nodes: step.partial_nodes as u32,
        }))
    }

    async fn pool_status(&self, req: Request<pb::PoolStatusRequest>) -> Reply<pb::PoolStatusResponse> {
        let id = self.who(&req)?;
        let r = req.into_inner();
        self.require(&id, &r.partition, Role::Viewer)?;
        let pool = self.agents.as_ref().and_then(|h| h.pools.get()).and_then(|p| p.of(&r.partition).cloned());
        let pool = pool.ok_or_else(|| ServeError::FailedPrecondition(format!("partition {} is not a pool partition (fleet config [[pool]])", r.partition)))?;
        let mut status = pool.status(&self.live);
        // Fits a reply whatever the pool's size: the latest steps go first.
        let mut size = prost::Message::encoded_len(&status);
        for e in status.executors.iter_mut().rev() {
            if size <= bounds::REPLY_BYTES {
                break;
            }
            size -= e.recent.iter().map(|s| prost::Message::encoded_len(s) + 2).sum::<usize>();
            e.recent.clear();
        }
        Ok(Response::new(status))
    }

    async fn list_compactions(&self, req: Request<pb::ListCompactionsRequest>) -> Reply<pb::ListCompactionsResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let r = req.into_inner();
            let limit = if r.limit == 0 { 100 } else { (r.limit as usize).min(1000) };
            let mut chains = Vec::new();
            for p in this.viewable(&id, &r.partition)? {
                let name = this.live.partitions[p].name.clone();
                for c in this.live.compactions(&name, limit)? {
                    chains.push(pb::CompactionChain {
                        id: c.id,
                        partition: name.clone(),
                        policy: c.policy,
                        state: c.state.as_str().into(),
                        cause: c.cause,
                        started_unix_ms: c.started_unix_ms,
                        ended_unix_ms: c.ended_unix_ms,
                        nodes_freed: c.nodes_freed,
                        benefit_gpu_s: c.benefit_gpu_s,
                        cost_gpu_s: c.cost_gpu_s,
                        moves: c
                            .moves
                            .into_iter()
                            .map(|m| pb::CompactionMove {
                                job_id: m.job_id,
                                from_allocation: m.from_allocation,
                                to_allocation: m.to_allocation,
                                from_node: m.from_node,
                                to_node: m.to_node,
                                to_gpus: m.to_gpus,
                                tier: m.tier,
                                state_bytes: m.state_bytes,
                                state: m.state.as_str().into(),
                                overlap_ms: m.overlap_ms,
                                warmup_ms: m.warmup_ms,
                                cause: m.cause,
                                rate_before_milli: m.rate_before_milli,
                                rate_after_milli: m.rate_after_milli,
                                neighbours_before_milli: m.neighbours_before_milli,
                                neighbours_after_milli: m.neighbours_after_milli,
                                rate_measure: m.rate_measure,
                            })
                            .collect(),
                        bytes_same_switch: c.bytes_by_tier[0],
                        bytes_same_aggregation: c.bytes_by_tier[1],
                        bytes_cross_aggregation: c.bytes_by_tier[2],
                        idle_nodes_before: c.idle_nodes_before,
                        idle_nodes_after: c.idle_nodes_after,
                        pending_startable_before: c.pending_startable_before,
                        pending_startable_after: c.pending_startable_after,
                    });
                }
            }
            chains.sort_by_key(|c| std::cmp::Reverse(c.started_unix_ms));
            chains.truncate(limit);
            Ok(Response::new(pb::ListCompactionsResponse { chains }))
        }).await
    }

    async fn quote(&self, req: Request<pb::QuoteRequest>) -> Reply<pb::QuoteResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let q = req.into_inner();
            this.require(&id, &q.partition, Role::Viewer)?;
            let p = this.live.partition_index(&q.partition)?;
            let bad = |m: String| Status::from(ServeError::Invalid(m));
            let tasks = q.tasks.max(1);
            if tasks > 4096 {
                return Err(bad(format!("{tasks} tasks: at most 4096")));
            }
            if !(q.deadline_h.is_finite() && (0.0..=24.0 * 365.0).contains(&q.deadline_h)) {
                return Err(bad(format!("deadline_h {} must be in [0, 8760] (0: none)", q.deadline_h)));
            }
            if q.models.len() > 64 || q.models.iter().any(|m| m.len() > 256) {
                return Err(bad("at most 64 models of 256 bytes".into()));
            }
            if !(q.duration_h.is_finite() && (0.0..=24.0 * 365.0).contains(&q.duration_h)) {
                return Err(bad(format!("duration_h {} must be in [0, 8760] (0: not asked)", q.duration_h)));
            }
            if q.samples > berth_core::forecast::MAX_SAMPLES || q.budget_ms > 10_000 {
                return Err(bad(format!("samples {} (at most 10,000) and budget_ms {} (at most 10,000)", q.samples, q.budget_ms)));
            }
            let st = this.live.partitions[p].lock_state();
            let models = q
                .models
                .iter()
                .map(|m| st.fleet.model_id(m).ok_or_else(|| bad(format!("unknown GPU model \"{}\" (partition {} has {:?})", crate::text::printable(m, 64), q.partition, st.fleet.models))))
                .collect::<Result<Vec<_>, _>>()?;
            let gpu_milli = if q.gpus > 0 && q.gpu_milli == 0 { 1000 } else { q.gpu_milli };
            let shape = TaskShape { gpu_count: q.gpus, gpu_milli, cpu_milli: q.cpu_milli, memory_mib: q.memory_mib, models };
            shape.check().map_err(|e| bad(format!("task shape: {e}")))?;
            let deadline_s = (q.deadline_h > 0.0).then(|| (q.deadline_h * 3600.0).ceil() as u64);
            let request = PendingShape { shape, tasks, same_domain: q.same_domain };
            let fleet = st.fleet_of_kind(q.agent_nodes);
            let quote = st.quote(&fleet, &request, deadline_s);
            let queued_ahead = st.queued_at_or_above(q.priority);
            let tiers = this.buyable_tiers(&id, &q.partition);
            let offers = st.offers(&fleet, &request, q.priority, &tiers, &this.live.contract);
            // The chance runs on a copy of the state, off the partition's lock.
            let rates = this.live.work.as_ref().map(|w| w.rates(&st.fleet));
            let inputs = deadline_s.map(|_| st.forecast_inputs(fleet, q.agent_nodes, q.priority, st.clock.unix_ms(), rates.as_ref()));
            drop(st);
            let mut reply = pb::QuoteResponse {
                now: quote.now,
                has_next: quote.next_in_s.is_some(),
                next_in_s: quote.next_in_s.unwrap_or(0),
                has_deadline: quote.meets_deadline.is_some(),
                meets_deadline: quote.meets_deadline.unwrap_or(false),
                queued_ahead,
                offers,
                ..Default::default()
            };
            if let (Some(inputs), Some(deadline_s)) = (inputs, deadline_s) {
                let started = std::time::Instant::now();
                let samples = if q.samples == 0 { 1_000 } else { q.samples };
                let budget = std::time::Duration::from_millis(if q.budget_ms == 0 { 1_000 } else { u64::from(q.budget_ms) });
                // Seeded by the request: the same question on the same state
                // gets the same answer (when every run is made in the budget).
                let seed = {
                    use std::hash::{Hash, Hasher};
                    let mut h = std::hash::DefaultHasher::new();
                    format!("{q:?}").hash(&mut h);
                    h.finish()
                };
                let now = berth_core::forecast::Now { fleet: &inputs.fleet, running: &inputs.running, queued: &inputs.queued, rates: rates.as_ref() };
                let c = crate::forecast::chance_within(now, &request, &inputs.history, deadline_s, samples, seed, budget);
                let gpus = f64::from(tasks) * f64::from(request.shape.gpu_count) * f64::from(request.shape.gpu_milli) / 1000.0;
                reply.has_chance = true;
                reply.probability = c.probability;
                reply.low = c.low;
                reply.high = c.high;
                reply.samples = c.samples;
                reply.started = c.started;
                reply.elapsed_ms = started.elapsed().as_millis() as u64;
                reply.has_start = c.median_start_s.is_some();
                reply.median_start_s = c.median_start_s.unwrap_or(0);
                reply.rate = c.rate.unwrap_or(0.0);
                reply.goodput_gpu_h = c.rate.unwrap_or(0.0) * gpus * q.duration_h;
            }
            Ok(Response::new(reply))
        }).await
    }

    async fn query_decisions(&self, req: Request<pb::QueryDecisionsRequest>) -> Reply<pb::QueryDecisionsResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let r = req.into_inner();
            let allowed: Vec<String> = this.viewable(&id, &r.partition)?.into_iter().map(|p| this.live.partitions[p].name.clone()).collect();
            let filter = Filter {
                partition: (!r.partition.is_empty()).then_some(r.partition.clone()),
                job_id: (r.job_id != 0).then_some(r.job_id),
                policy_version: (r.policy_version != 0).then_some(r.policy_version),
                include_shadow: r.include_shadow,
                limit: usize::MAX,
            };
            let limit = if r.limit == 0 { 100 } else { r.limit as usize };
            let mut decisions: Vec<pb::Decision> =
                this.live.decisions.query(&filter).into_iter().filter(|d| allowed.contains(&d.partition)).take(limit).map(decision_message).collect();
            fit_reply(&mut decisions);
            Ok(Response::new(pb::QueryDecisionsResponse { decisions }))
        }).await
    }

    async fn upload_policy(&self, req: Request<pb::UploadPolicyRequest>) -> Reply<pb::UploadPolicyResponse> {
        let id = self.who(&req)?;
        let r = req.into_inner();
        self.require(&id, &r.partition, Role::Operator)?;
        let live = self.live.clone();
        let hook = PolicyHook::parse(&r.hook)?;
        let (meta, created) = blocking(move || live.upload_hook(&id.name, &r.partition, hook, &r.component, &r.config, &r.note)).await?;
        Ok(Response::new(pb::UploadPolicyResponse { policy: Some(policy_ref(&meta)), created }))
    }

    async fn activate_policy(&self, req: Request<pb::ActivatePolicyRequest>) -> Reply<pb::ActivatePolicyResponse> {
        let id = self.who(&req)?;
        let r = req.into_inner();
        self.require(&id, &r.partition, Role::Operator)?;
        let live = self.live.clone();
        let hook = PolicyHook::parse(&r.hook)?;
        let swap = blocking(move || live.activate_hook(&id.name, &r.partition, hook, r.version, "activate")).await?;
        Ok(Response::new(pb::ActivatePolicyResponse {
            active: Some(policy_ref(&swap.active)),
            previous: swap.previous.as_ref().map(policy_ref),
            swap_us: swap.took.as_micros() as u64,
        }))
    }

    async fn rollback_policy(&self, req: Request<pb::RollbackPolicyRequest>) -> Reply<pb::ActivatePolicyResponse> {
        let id = self.who(&req)?;
        let r = req.into_inner();
        self.require(&id, &r.partition, Role::Operator)?;
        let live = self.live.clone();
        let hook = PolicyHook::parse(&r.hook)?;
        let swap = blocking(move || live.rollback_hook(&id.name, &r.partition, hook, (r.version != 0).then_some(r.version))).await?;
        Ok(Response::new(pb::ActivatePolicyResponse {
            active: Some(policy_ref(&swap.active)),
            previous: swap.previous.as_ref().map(policy_ref),
            swap_us: swap.took.as_micros() as u64,
        }))
    }

    async fn policy_history(&self, req: Request<pb::PolicyHistoryRequest>) -> Reply<pb::PolicyHistoryResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let r = req.into_inner();
            let partition = r.partition;
            this.require(&id, &partition, Role::Viewer)?;
            let hook = PolicyHook::parse(&r.hook)?;
            let record = this.live.registry.record(&hook_key(&partition, hook))?;
            Ok(Response::new(pb::PolicyHistoryResponse {
                versions: record
                    .versions
                    .iter()
                    .map(|m| pb::PolicyVersion {
                        policy: Some(policy_ref(m)),
                        contract: m.contract.clone(),
                        uploaded_by: m.uploaded_by.clone(),
                        uploaded_unix_ms: m.uploaded_unix_ms,
                        note: m.note.clone(),
                        config: m.config.clone(),
                        blocked_until_unix_ms: m.blocked_until_unix_ms,
                    })
                    .collect(),
                events: record
                    .events
                    .iter()
                    .map(|e| pb::PolicyEvent { unix_ms: e.unix_ms, kind: e.kind.clone(), version: e.version, by: e.by.clone(), detail: e.detail.clone() })
                    .collect(),
                active_version: record.active.unwrap_or(0),
            }))
        }).await
    }

    async fn set_shadow(&self, req: Request<pb::SetShadowRequest>) -> Reply<pb::SetShadowResponse> {
        let id = self.who(&req)?;
        let r = req.into_inner();
        self.require(&id, &r.partition, Role::Operator)?;
        let hook = super::state::PolicyHook::parse(&r.hook)?;
        if hook != super::state::PolicyHook::Place {
            let version = match pb::ShadowMode::try_from(r.mode) {
                Ok(pb::ShadowMode::Off) => None,
                Ok(pb::ShadowMode::Shadow) => Some(r.version),
                _ => return Err(ServeError::Invalid(format!("a {} candidate runs in shadow (or off); split is for placement", hook.as_str())).into()),
            };
            let live = self.live.clone();
            blocking(move || live.set_aux_shadow(&id.name, &r.partition, hook, version)).await?;
            return Ok(Response::new(pb::SetShadowResponse {}));
        }
        let setting = match pb::ShadowMode::try_from(r.mode) {
            Ok(pb::ShadowMode::Off) => None,
            Ok(pb::ShadowMode::Shadow) => Some((r.version, Mode::Shadow)),
            Ok(pb::ShadowMode::Split) => Some((r.version, Mode::Split(r.fraction))),
            Err(_) => return Err(ServeError::Invalid(format!("unknown shadow mode {}", r.mode)).into()),
        };
        let live = self.live.clone();
        blocking(move || live.set_shadow(&id.name, &r.partition, setting)).await?;
        Ok(Response::new(pb::SetShadowResponse {}))
    }

    async fn shadow_report(&self, req: Request<pb::ShadowReportRequest>) -> Reply<pb::ShadowReportResponse> {
        let this = self.clone();
        crate::util::off_worker(move || {
            let id = this.who(&req)?;
            let r = req.into_inner();
            let partition = r.partition;
            this.require(&id, &partition, Role::Viewer)?;
            let part = &this.live.partitions[this.live.partition_index(&partition)?];
            let hook = super::state::PolicyHook::parse(&r.hook)?;
            if hook == super::state::PolicyHook::Pool {
                let candidate = part.pool.candidate.lock().unwrap().clone();
                let active = part.pool.active.lock().unwrap().clone();
                let s = part.pool.stats.lock().unwrap().clone();
                let tally = |t: &super::shadow::PlaceTally, n: u64| pb::PoolPlaceTally {
                    mean_pairs: shadow::mean(t.pairs as f64, n),
                    mean_models_placed: shadow::mean(t.models_placed as f64, n),
                    mean_executors_used: shadow::mean(t.executors_used as f64, n),
                    mean_unplaced_rate: shadow::mean(t.unplaced_rate, n),
                    mean_busiest_offered: shadow::mean(t.busiest_offered, n),
                };
                let placed = s.replans - s.candidate_errors;
                return Ok(Response::new(pb::ShadowReportResponse {
                    mode: if candidate.is_some() { "shadow".into() } else { "off".into() },
                    active: active.map(|a| policy_ref(&a.meta)),
                    candidate: candidate.map(|c| policy_ref(&c.meta)),
                    samples: s.replans + s.steps,
                    agreement_rate: shadow::mean((s.agreed + s.steps_agreed) as f64, s.replans + s.steps),
                    candidate_errors: s.candidate_errors + s.step_errors,
                    pool: Some(pb::PoolShadow {
                        replans: s.replans,
                        agreed: s.agreed,
                        active: Some(tally(&s.active, s.replans)),
                        candidate: Some(tally(&s.candidate, placed)),
                        candidate_errors: s.candidate_errors,
                        steps: s.steps,
                        steps_agreed: s.steps_agreed,
                        step_errors: s.step_errors,
                    }),
                    ..Default::default()
                }));
            }
            if hook == super::state::PolicyHook::Compact {
                let candidate = part.compact.candidate.lock().unwrap().clone();
                let active = part.compact.active.lock().unwrap().clone();
                let s = part.compact.stats.lock().unwrap().clone();
                let tally = |t: &super::shadow::CompactTally| pb::CompactTally {
                    chains: t.chains,
                    moves: t.moves,
                    nodes_freed: t.nodes_freed,
                    state_bytes: t.state_bytes,
                    benefit_gpu_s: t.benefit_gpu_s,
                    cost_gpu_s: t.cost_gpu_s,
                };
                return Ok(Response::new(pb::ShadowReportResponse {
                    mode: if candidate.is_some() { "shadow".into() } else { "off".into() },
                    active: active.map(|a| policy_ref(&a.meta)),
                    candidate: candidate.map(|c| policy_ref(&c.meta)),
                    samples: s.steps,
                    candidate_errors: s.candidate_errors,
                    compact: Some(pb::CompactShadow { steps: s.steps, active: Some(tally(&s.active)), candidate: Some(tally(&s.candidate)), candidate_errors: s.candidate_errors }),
                    ..Default::default()
                }));
            }
            if hook == super::state::PolicyHook::Rank {
                let candidate = part.rank.candidate.lock().unwrap().clone();
                let s = part.rank.stats.lock().unwrap().clone();
                return Ok(Response::new(pb::ShadowReportResponse {
                    mode: if candidate.is_some() { "shadow".into() } else { "off".into() },
                    active: part.ranker().map(|a| policy_ref(&a.meta)),
                    candidate: candidate.map(|c| policy_ref(&c.meta)),
                    samples: s.samples,
                    agreement_rate: if s.samples == 0 { 0.0 } else { s.agreed as f64 / s.samples as f64 },
                    candidate_errors: s.candidate_errors,
                    rank: Some(pb::RankShadow {
                        samples: s.samples,
                        agreed: s.agreed,
                        active_victims: s.active_victims,
                        candidate_victims: s.candidate_victims,
                        active_lost_gpu_s: s.active_lost_gpu_s,
                        candidate_lost_gpu_s: s.candidate_lost_gpu_s,
                        candidate_errors: s.candidate_errors,
                    }),
                    ..Default::default()
                }));
            }
            let active = part.active();
            let candidate = part.candidate();
            let s = part.place.stats.lock().unwrap().clone();
            let arm = |name: &str, a: &shadow::ArmStats, m: Option<&VersionMeta>| pb::ArmOutcome {
                arm: name.into(),
                policy: m.map(policy_ref),
                decisions: a.decisions,
                placed: a.placed,
                errors: a.errors,
                mean_latency_us: shadow::mean(a.latency_us_sum as f64, a.decisions),
                mean_wait_s: shadow::mean(a.wait_s_sum, a.placed),
                mean_domains_per_gang: shadow::mean(a.gang_domains_sum as f64, a.gangs),
                mean_partial_nodes_after: shadow::mean(a.partial_after_sum as f64, a.decisions),
            };
            let active_meta = active.as_ref().map(|a| &a.meta);
            let candidate_meta = candidate.as_ref().map(|c| &c.arm.meta);
            let split = candidate.as_ref().is_some_and(|c| matches!(c.mode, Mode::Split(_)));
            Ok(Response::new(pb::ShadowReportResponse {
                mode: match candidate.as_ref().map(|c| c.mode) {
                    None => "off".into(),
                    Some(Mode::Shadow) => "shadow".into(),
                    Some(Mode::Split(f)) => format!("split {f}"),
                },
                active: active_meta.map(policy_ref),
                candidate: candidate_meta.map(policy_ref),
                samples: s.samples,
                agreement_rate: shadow::mean(s.agree as f64, s.samples),
                mean_candidate_score_gap: shadow::mean(s.candidate_gap.0, s.candidate_gap.1),
                mean_active_score_gap: shadow::mean(s.active_gap.0, s.active_gap.1),
                mean_domains_active: shadow::mean(s.domains_active as f64, s.gang_samples),
                mean_domains_candidate: shadow::mean(s.domains_candidate as f64, s.gang_samples),
                mean_partial_nodes_active: shadow::mean(s.partial_active as f64, s.samples),
                mean_partial_nodes_candidate: shadow::mean(s.partial_candidate as f64, s.samples),
                candidate_errors: s.candidate_errors,
                recent_diffs: s
                    .recent_diffs
                    .iter()
                    .rev()
                    .map(|d| pb::ShadowDiff {
                        decision_id: d.decision_id,
                        job_id: d.job_id,
                        active: task_placements(&d.active),
                        candidate: task_placements(&d.candidate),
                        note: d.note.clone(),
                    })
                    .collect(),
                arms: if split { vec![arm("active", &s.arms[0], active_meta), arm("candidate", &s.arms[1], candidate_meta)] } else { Vec::new() },
                rank: None,
                compact: None,
                pool: None,
                points: s
                    .points
                    .iter()
                    .map(|p| pb::ShadowPoint {
                        unix_ms: p.unix_ms,
                        job_id: p.job_id,
                        agree: p.agree,
                        candidate_gap: p.candidate_gap,
                        active_gap: p.active_gap,
                        partial_active: p.partial_after.0,
                        partial_candidate: p.partial_after.1,
                    })
                    .collect(),
            }))
        }).await
    }
}
