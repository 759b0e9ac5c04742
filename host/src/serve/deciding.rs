//! How a partition decides: its queue is the core's [`Engine`], the same
//! state machine replay drives, so queue order, the predicate, gangs, the
//! starvation guard and preemption are written once. This module hands the
//! engine the partition's policies (the active placement version, a split
//! candidate routed by job id, the rank version or the documented default
//! ranking), watches every placement attempt (decision log, shadow
//! candidate on the same state, A/B tallies, breaker) and turns the
//! engine's decisions into job records, process starts and evictions under
//! the priority contract.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_core::engine::{Deciders, Decision, Hook, Observer, World};
use berth_core::fleet::{Node, NodeId};
use berth_core::preemption::PreemptionPolicy;
use berth_core::{Allocation, Fleet, Job, PlacementPolicy, Placer, PolicyError};
use berth_sdk::{Allocations, Domains, Nodes, Scores, Task};

use super::breaker;
use super::decisions::{DecisionRecord, Placed};
use super::state::{Arm, Candidate, JobState, Live, Partition, PartitionState};
use super::shadow::{self, Mode, Recording};
use sha2::{Digest, Sha256};


/// What the deciding arms did for the job being placed: shared by the
/// chooser (which calls them) and the observer (which logs).
#[derive(Default)]
struct Attempt {
    calls: u32,
    /// The split candidate decided this job.
    candidate: bool,
    /// The split candidate failed it: the active version decided.
    fell_back: Option<PolicyError>,
    latency: Duration,
    candidate_latency: Duration,
    /// The deciding arm's first scores (candidate node ids, scores).
    first: Option<(Vec<u32>, Vec<f64>)>,
}

/// The placement policy the engine sees: the active version, or for a
/// split candidate's share of jobs the candidate, falling back to the
/// active version for the rest of a job the candidate failed.
struct ArmChooser {
    active: Arc<Arm>,
    split: Option<(Arc<Arm>, f64)>,
    attempt: Rc<RefCell<Attempt>>,
}

impl ArmChooser {
    fn call<T>(&mut self, job_id: u64, mut f: impl FnMut(&mut dyn PlacementPolicy) -> Result<T, PolicyError>) -> Result<T, PolicyError> {
        let mut at = self.attempt.borrow_mut();
        at.calls += 1;
        if let Some((cand, fraction)) = &self.split
            && at.fell_back.is_none()
            && shadow::in_split(job_id, *fraction)
        {
            let started = Instant::now();
            let r = f(&mut *cand.policy.lock().unwrap());
            at.candidate_latency += started.elapsed();
            match r {
                Ok(v) => {
                    at.candidate = true;
                    return Ok(v);
                }
                Err(e) => {
                    at.candidate = false;
                    at.fell_back = Some(e);
                }
            }
        }
        let started = Instant::now();
        let r = f(&mut *self.active.policy.lock().unwrap());
        at.latency += started.elapsed();
        r
    }
}

impl PlacementPolicy for ArmChooser {
    fn describe(&self) -> String {
        format!("{}@{} (version {})", self.active.meta.name, self.active.meta.semver, self.active.meta.version)
    }

    fn score(&mut self, task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        let attempt = self.attempt.clone();
        let r = self.call(task.job_id, |p| p.score(task, nodes));
        let mut at = attempt.borrow_mut();
        if at.first.is_none()
            && let Ok(s) = &r
        {
            at.first = Some((nodes.ids.clone(), s.scores.clone()));
        }
        r
    }

    fn score_domains(&mut self, task: &Task, domains: &mut Domains) -> Result<Option<Vec<f64>>, PolicyError> {
        self.call(task.job_id, |p| p.score_domains(task, domains))
    }
}

/// The rank hook: the partition's rank version, or the documented default
/// order (lowest priority first, then least work lost) when none is active
/// or the breaker took it out.
struct RankChooser {
    arm: Option<Arc<Arm>>,
}

impl PreemptionPolicy for RankChooser {
    fn describe(&self) -> String {
        match &self.arm {
            Some(a) => format!("{}@{} (rank version {})", a.meta.name, a.meta.semver, a.meta.version),
            None => "default ranking".into(),
        }
    }

    fn rank(&mut self, demand: &Task, victims: &mut Allocations) -> Result<Option<Vec<u32>>, PolicyError> {
        match &self.arm {
            Some(a) => PreemptionPolicy::rank(&mut *a.policy.lock().unwrap(), demand, victims),
            None => Ok(None),
        }
    }
}

/// Watches the engine's placement attempts.
struct LiveObserver<'a> {
    live: &'a Live,
    p: usize,
    part: &'a Partition,
    active: Arc<Arm>,
    candidate: Option<Arc<Candidate>>,
    attempt: Rc<RefCell<Attempt>>,
    /// Owner and submission time of every pending job.
    owners: HashMap<u64, (String, Instant)>,
    /// The shadow candidate's own placer and its run on the current job.
    placer: Placer,
    shadow_run: Option<(ArmRun, Fleet, u64)>,
    digest: String,
    /// Per job decided: the explanation, the decision id and version.
    notes: Vec<(u64, String, u64, u32)>,
    trip: Trip,
}

impl LiveObserver<'_> {
    fn base(&self, job: &Job) -> DecisionRecord {
        DecisionRecord {
            id: 0,
            unix_ms: self.live.now_ms(),
            partition: self.part.name.clone(),
            job_id: job.id,
            actor: self.owners.get(&job.id).map(|o| o.0.clone()).unwrap_or_default(),
            arm: String::new(),
            actuated: true,
            policy: String::new(),
            policy_semver: String::new(),
            policy_version: 0,
            sha256: String::new(),
            input_digest: self.digest.clone(),
            outcome: String::new(),
            detail: String::new(),
            placements: Vec::new(),
            latency_us: 0,
        }
    }

    fn note_trip(&mut self, trip: Trip) {
        if trip != Trip::None {
            self.trip = trip;
        }
    }
}

impl Observer for LiveObserver<'_> {
    fn after_rank(&mut self, fleet: &Fleet, demand: &Job, candidates: &[berth_core::preemption::Candidate], keep: &dyn Fn(NodeId, &Node) -> bool, chosen: Option<&[usize]>) {
        let Some(shadow) = self.part.rank.candidate.lock().unwrap().clone() else { return };
        let theirs = berth_core::preemption::select_victims(fleet, &mut *shadow.policy.lock().unwrap(), demand, candidates, keep);
        let lost = |picked: &[usize]| -> f64 {
            picked.iter().map(|&k| candidates[k].held.iter().map(|a| a.gpu_milli_total()).sum::<u64>() as f64 / 1000.0 * candidates[k].since_checkpoint_s as f64).sum()
        };
        let mut s = self.part.rank.stats.lock().unwrap();
        s.samples += 1;
        let mine = chosen.unwrap_or_default();
        s.active_victims += mine.len() as u64;
        s.active_lost_gpu_s += lost(mine);
        match theirs {
            Err(_) => s.candidate_errors += 1,
            Ok(theirs) => {
                let theirs = theirs.unwrap_or_default();
                s.candidate_victims += theirs.len() as u64;
                s.candidate_lost_gpu_s += lost(&theirs);
                let (mut a, mut b) = (mine.to_vec(), theirs);
                a.sort_unstable();
                b.sort_unstable();
                s.agreed += u64::from(a == b);
            }
        }
    }

    fn before_place(&mut self, fleet: &Fleet, job: &Job, keep: &dyn Fn(NodeId, &Node) -> bool) {
        *self.attempt.borrow_mut() = Attempt::default();
        self.digest = input_digest(fleet, job);
        self.shadow_run = None;
        // Shadow: same inputs, a scratch copy of the fleet, never actuated.
        if let Some(c) = self.candidate.as_deref()
            && c.mode == Mode::Shadow
        {
            let mut scratch = fleet.clone();
            let run = run_arm(&c.arm, &mut scratch, &mut self.placer, job, keep);
            let base = self.base(job);
            let decision = self.live.log(&base, "shadow", false, &c.arm, &run, &scratch);
            let trip = self.live.after_call(self.p, &c.arm, &run, false);
            self.note_trip(trip);
            self.shadow_run = Some((run, scratch, decision));
        }
    }

    fn after_place(&mut self, fleet: &Fleet, job: &Job, result: &Result<Option<(Vec<Allocation>, u32)>, PolicyError>) {
        let at = std::mem::take(&mut *self.attempt.borrow_mut());
        if at.calls == 0 {
            // The predicate ruled it out before any policy call: no
            // decision is made or logged.
            self.notes.push((job.id, "no room: too few nodes pass the hard constraints now".into(), 0, 0));
            return;
        }
        let base = self.base(job);
        let waited_s = self.owners.get(&job.id).map_or(0.0, |o| o.1.elapsed().as_secs_f64());
        let split = self.candidate.as_ref().filter(|c| matches!(c.mode, Mode::Split(_))).map(|c| c.arm.clone());
        let outcome = |r: &Result<Option<(Vec<Allocation>, u32)>, PolicyError>| r.as_ref().ok().and_then(|r| r.as_ref()).map(|(_, d)| (waited_s, *d, job.tasks > 1));
        if let (Some(e), Some(cand)) = (at.fell_back.clone(), split.as_ref()) {
            // The candidate failed this job: the active version decided it,
            // so a bad candidate never strands work.
            let run = ArmRun { result: Err(e), first: None, latency: at.candidate_latency };
            self.live.log(&base, "candidate", true, cand, &run, fleet);
            let trip = self.live.after_call(self.p, cand, &run, false);
            self.note_trip(trip);
            self.part.place.stats.lock().unwrap().arms[1].record(at.candidate_latency.as_micros() as u64, None, true, partly_used(fleet));
        }
        let (arm, name, latency) = match (&split, at.candidate) {
            (Some(c), true) => (c.clone(), "candidate", at.candidate_latency),
            _ => (self.active.clone(), "active", at.latency),
        };
        let run = ArmRun { result: result.clone(), first: at.first, latency };
        let decision = self.live.log(&base, name, true, &arm, &run, fleet);
        let trip = self.live.after_call(self.p, &arm, &run, name == "active");
        self.note_trip(trip);
        if split.is_some() {
            let idx = usize::from(name == "candidate");
            self.part.place.stats.lock().unwrap().arms[idx].record(latency.as_micros() as u64, outcome(&run.result), run.result.is_err(), partly_used(fleet));
        }
        if let Some((srun, scratch, sd)) = self.shadow_run.take() {
            self.live.compare(self.part, job, &run, fleet, &srun, &scratch, sd);
        }
        let m = &arm.meta;
        let note = match &run.result {
            Ok(Some(_)) => format!("decision {decision}: placed by {}@{} (version {})", m.name, m.semver, m.version),
            Ok(None) => format!("decision {decision}: no room now (version {})", m.version),
            Err(e) => format!("decision {decision}: version {} failed: {e}", m.version),
        };
        self.notes.push((job.id, note, decision, m.version));
    }
}

impl Live {
    /// One walk of partition `p`'s queue by its engine; the decisions are
    /// recorded, stored and actuated before the lock is let go.
    pub(super) fn pass(&self, p: usize) {
        let part = &self.partitions[p];
        // The versions for this pass: a swap after this point applies to
        // the next one.
        let Some(active) = part.active() else { return };
        let candidate = part.candidate();
        let ranker = part.ranker();
        let mut guard = part.lock_state();
        let st = &mut *guard;
        if st.paused {
            return;
        }
        let attempt = Rc::new(RefCell::new(Attempt::default()));
        let split = candidate.as_ref().and_then(|c| match c.mode {
            Mode::Split(f) => Some((c.arm.clone(), f)),
            Mode::Shadow => None,
        });
        let mut chooser = ArmChooser { active: active.clone(), split, attempt: attempt.clone() };
        let mut rank = RankChooser { arm: ranker.clone() };
        let owners = st.pending.iter().filter_map(|id| st.jobs.get(id).map(|j| (*id, (j.owner.clone(), j.submitted_at)))).collect();
        let mut observer = LiveObserver {
            live: self,
            p,
            part,
            active,
            candidate,
            attempt,
            owners,
            placer: Placer::new(),
            shadow_run: None,
            digest: String::new(),
            notes: Vec::new(),
            trip: Trip::None,
        };
        if st.capture.is_some() {
            use berth_core::capture::{Input, PolicyRef};
            let of = |arm: &Arm| PolicyRef { sha256: arm.meta.sha256.clone(), config: arm.meta.config.clone(), instance: arm.instance };
            let arms = Input::Arms { place: of(&chooser.active), split: chooser.split.as_ref().map(|(c, f)| (of(c), *f)), rank: ranker.as_deref().map(of) };
            st.note_for_capture(arms);
        }
        // Jobs with a command run on agent nodes only; simulated jobs never do.
        let is_agent = std::mem::take(&mut st.is_agent);
        let eligible = |job: &Job, id: NodeId, _: &Node| is_agent.get(id as usize).copied().unwrap_or(false) == job.reports_exit;
        let now = self.now_s();
        let started = Instant::now();
        let pass = {
            let mut deciders = Deciders { placement: &mut chooser, preemption: Some(&mut rank), compaction: None };
            let mut world = World { eligible: Some(&eligible), observer: Some(&mut observer) };
            st.engine.handle(&mut st.fleet, now, [], &mut deciders, &mut world)
        };
        st.is_agent = is_agent;
        // The whole decision: queue walk, placement and rank calls,
        // validation (an eviction's record carries it).
        let pass_us = started.elapsed().as_micros() as u64;
        let (notes, trip) = (std::mem::take(&mut observer.notes), observer.trip);
        drop(observer);
        let mut last: HashMap<u64, (String, u64, u32)> = HashMap::new();
        for (job, note, decision, version) in notes {
            last.insert(job, (note, decision, version));
        }
        if let Some(arm) = ranker.as_ref()
            && pass.decisions.iter().any(|d| matches!(d, Decision::Evict { wake: false, .. }))
        {
            // The rank version answered (its answer was used).
            part.rank.breaker.lock().unwrap().record(arm.meta.version, super::breaker::Call::Answered(Duration::ZERO), &self.breaker);
        }
        for d in pass.decisions {
            self.apply_decision(part, st, d, &last, ranker.as_deref(), pass_us);
        }
        for (job, (note, _, _)) in &last {
            if let Some(r) = st.jobs.get_mut(job)
                && r.state == JobState::Pending
                && !r.evicting
            {
                r.last_decision = note.clone();
            }
        }
        if let Some((slot, hook, e)) = pass.error {
            let job_id = slot.map(|s| st.engine.job(s).id);
            let trip = match hook {
                Hook::Rank => self.rank_failed(p, ranker.as_ref(), &e),
                _ => trip,
            };
            if let Some(id) = job_id
                && let Some(r) = st.jobs.get_mut(&id)
                && hook == Hook::Rank
            {
                r.last_decision = format!("preemption ranking failed: {e}");
            }
            // Try again shortly, on whatever version is active by then.
            let soon = if trip == Trip::None { 50 } else { 1 };
            st.retry_at = Some(self.clock.now() + Duration::from_millis(soon));
        }
        if trip == Trip::Paused {
            st.paused = true;
        }
    }

    /// The rank version failed a call: its breaker may take it out, and the
    /// default ranking decides from then on.
    fn rank_failed(&self, p: usize, arm: Option<&Arc<Arm>>, e: &PolicyError) -> Trip {
        let part = &self.partitions[p];
        let Some(arm) = arm else { return Trip::None };
        let v = arm.meta.version;
        self.metrics.policy_failures.with_label_values(&[&part.name, &arm.meta.name, &v.to_string(), super::breaker::kind(e)]).inc();
        tracing::warn!(target: "berth::serve", partition = %part.name, version = v, "rank policy call failed: {e}");
        if !super::breaker::counts(e) {
            return Trip::None;
        }
        // Bound first: trip_aux() does not take the lock, but keep it short.
        let tripped = part.rank.breaker.lock().unwrap().record(v, super::breaker::Call::Failed(e), &self.breaker);
        match tripped {
            None => Trip::None,
            Some(reason) => {
                self.trip_aux(p, super::state::PolicyHook::Rank, arm, &reason);
                Trip::Replaced
            }
        }
    }

    /// Records one engine decision and actuates it.
    pub(super) fn apply_decision(&self, part: &Partition, st: &mut PartitionState, d: Decision, last: &HashMap<u64, (String, u64, u32)>, ranker: Option<&Arm>, pass_us: u64) {
        match d {
            Decision::Place { slot, job: id, allocations, victims, start_s, .. } => {
                let fleet_names = placed(&st.fleet, &allocations);
                // A simulated job starts once its victims have vacated (the
                // engine's start) and runs for what it has left (the work
                // it kept before a preemption taken off).
                let clock_now = self.clock.now();
                let delay = Duration::from_secs(start_s.saturating_sub(self.now_s()));
                let left = st.engine.planned_end(slot).map(|end| Duration::from_secs(end.saturating_sub(start_s)));
                // Preempted jobs whose processes still run: the new tasks
                // start when they are gone.
                // (And what an evicted victim itself still waited for: the
                // borrowers of a waking job it was, handed over at its eviction.)
                let inherited = st.jobs.get(&id).map(|j| j.waiting_on.clone()).unwrap_or_default();
                let mut waiting_on: Vec<u64> = victims.iter().chain(&inherited).copied().filter(|v| st.jobs.get(v).is_some_and(|j| j.evicting)).collect();
                waiting_on.sort_unstable();
                waiting_on.dedup();
                let Some(record) = st.jobs.get_mut(&id) else { return };
                record.sleep = super::state::SleepState::Awake;
                let agent_job = !record.spec.argv.is_empty();
                let mut ends_at = if agent_job {
                    (!record.spec.duration.is_zero()).then(|| clock_now + record.spec.duration)
                } else {
                    Some(clock_now + delay + left.map_or(record.spec.duration, |l| l.min(record.spec.duration)))
                };
                // An opportunistic budget ends the run when it is spent.
                let budget_left_s = record.budget_left_s();
                if let Some(budget_s) = budget_left_s {
                    let spent_at = clock_now + Duration::from_secs(budget_s);
                    ends_at = Some(ends_at.map_or(spent_at, |t| t.min(spent_at)));
                }
                let (note, decision, version) = last.get(&id).cloned().unwrap_or_default();
                record.state = JobState::Running;
                record.started_unix_ms = self.now_ms();
                record.ends_at = ends_at;
                record.allocations = allocations;
                record.placements = fleet_names;
                record.decision_id = decision;
                record.policy_version = version;
                record.last_decision = if victims.is_empty() { note } else { format!("{note}; preempted job(s) {victims:?}") };
                record.waiting_on = waiting_on;
                st.pending.retain(|&j| j != id);
                if let Some(t) = ends_at {
                    st.running.insert((t, id));
                }
                self.metrics.jobs.with_label_values(&[&part.name, "pending"]).dec();
                self.metrics.jobs.with_label_values(&[&part.name, "running"]).inc();
                // A budget already spent (taken back or requeued at its
                // end): nothing starts; its end, now, finishes it.
                if agent_job && st.jobs[&id].waiting_on.is_empty() && budget_left_s != Some(0) {
                    self.actuate(part, st, id);
                } else {
                    self.persist_logged(vec![st.job_op(&part.name, id)]);
                }
            }
            Decision::Evict { slot, job: id, for_job, ranker: ranked_by, stop_by_s, lost_gpu_s, wake, credit_gpu_h, broken, .. } => {
                // The victim's own contract (its notice), as the engine used.
                let contract = st.engine.config.contract_of(st.engine.job(slot));
                let Some(record) = st.jobs.get_mut(&id) else { return };
                // A copy being migrated in holds GPUs the engine never gave:
                // they stay fenced (an allocation of no job) until its exit
                // frees them, and it is stopped now.
                let mut fenced = Vec::new();
                let mut k = 0;
                while k < record.runs.len() {
                    if record.runs[k].replaces != 0 && record.runs[k].holds {
                        let (mut r, a) = (record.runs.remove(k), record.allocations.remove(k));
                        // The copy's unsaved work goes with it.
                        self.count_lost(&part.name, &record.spec.work_unit, &mut r, &mut record.work);
                        st.manual.insert(r.alloc_id, a);
                        st.lost.insert(r.alloc_id);
                        st.by_alloc.insert(r.alloc_id, 0);
                        fenced.push(r);
                    } else {
                        k += 1;
                    }
                }
                // Evicted while waking: the borrowers it waited for are its
                // preemptor's to wait for now (their processes may still
                // hold its GPUs).
                let handed_over = std::mem::take(&mut record.waiting_on);
                let mut detail = if wake {
                    format!("taken back from lent GPUs: job {for_job} wakes on them; {lost_gpu_s:.0} GPU-s of work lost")
                } else {
                    format!("preempted for job {for_job} (ranked by {ranked_by}); {lost_gpu_s:.0} GPU-s of work lost")
                };
                if let Some(b) = broken {
                    detail.push_str(&format!("; promise broken ({})", b.name()));
                }
                if credit_gpu_h > 0.0 {
                    detail.push_str(&format!("; {credit_gpu_h:.2} GPU-h credited to {}", crate::text::printable(&record.owner, 64)));
                }
                // Credited in the same write as the job's record.
                let owner = record.owner.clone();
                st.credits.preempted(&owner, lost_gpu_s, credit_gpu_h, broken.is_some());
                self.credit_metrics(&part.name, &owner, credit_gpu_h, broken);
                // The contract: a checkpoint notice now, the stop after the
                // notice period; the agent kills what is left after its stop
                // grace. The GPUs are the preemptor's once the processes are gone.
                // The fences are stored with the job, before anything is stopped.
                let mut ops: Vec<_> = fenced.iter().map(|r| st.held_op(&part.name, r.alloc_id)).collect();
                ops.push(crate::store::Op::Put(super::credits::key(&part.name), st.credits.stored()));
                // No notice (opportunistic work): the stop goes out now.
                let notice = (contract.notice_s > 0).then(|| Duration::from_secs(contract.notice_s));
                self.send_back(part, st, id, detail, notice, ops);
                if let Some(act) = self.actuator() {
                    for r in &fenced {
                        act.stop(r.alloc_id, &r.node);
                    }
                }
                if let Some(preemptor) = st.jobs.get_mut(&for_job) {
                    preemptor.waiting_on.extend(handed_over);
                }
                self.metrics.evictions.with_label_values(&[part.name.as_str(), if wake { "wake" } else { "preempt" }]).inc();
                self.metrics.lost_gpu_seconds.with_label_values(&[&part.name]).inc_by(lost_gpu_s);
                if wake {
                    self.metrics.harvest.with_label_values(&[&part.name, "wake_eviction"]).inc();
                }
                // The rank decision, with the version that ranked (a wake
                // takes back the borrowers on its GPUs: no ranking).
                let (policy, semver, version, sha) = match ranker {
                    _ if wake => ("wake".to_string(), String::new(), 0, String::new()),
                    Some(a) => (a.meta.name.clone(), a.meta.semver.clone(), a.meta.version, a.meta.sha256.clone()),
                    None => ("default-rank".to_string(), String::new(), 0, String::new()),
                };
                self.decisions.append(DecisionRecord {
                    id: 0,
                    unix_ms: self.now_ms(),
                    partition: part.name.clone(),
                    job_id: id,
                    actor: if wake { "harvest" } else { "rank" }.into(),
                    arm: if wake { "harvest" } else { "rank" }.into(),
                    actuated: true,
                    policy,
                    policy_semver: semver,
                    policy_version: version,
                    sha256: sha,
                    input_digest: String::new(),
                    outcome: "evicted".into(),
                    detail: format!("for job {for_job}; stop by {}; {lost_gpu_s:.0} GPU-s lost", stop_by_s),
                    placements: Vec::new(),
                    latency_us: pass_us,
                });
                tracing::info!(target: "berth::serve", partition = %part.name, job = id, for_job, "preempted: {}", st.jobs[&id].detail);
            }
            Decision::Reserve { job: id, until_s, nodes, .. } => {
                if let Some(record) = st.jobs.get_mut(&id) {
                    let when = until_s.saturating_sub(self.now_s());
                    record.last_decision = if until_s == u64::MAX {
                        format!("reserved {} node(s); no running work ends on plan to make room", nodes.len())
                    } else {
                        format!("reserved {} node(s) drained for it: starts within {when} s at the latest", nodes.len())
                    };
                    record.reserved_until_s = until_s;
                }
            }
            Decision::Sleep { job: id, gpus, .. } => self.fell_asleep(part, st, id, gpus),
            Decision::Wake { job: id, victims, requeued, .. } => self.woke(part, st, id, victims, requeued),
            Decision::Broken { job: id, promise, lost_gpu_s, credit_gpu_h, .. } => {
                if self.note_broken(&part.name, st, id, promise, lost_gpu_s, credit_gpu_h) {
                    self.persist_logged(vec![st.job_op(&part.name, id), crate::store::Op::Put(super::credits::key(&part.name), st.credits.stored())]);
                }
            }
        }
    }

    /// Records a broken promise to job `id`'s tenant: the job's last
    /// decision says it, the ledger credits it (the caller stores both, in
    /// one write). False when the job is gone.
    pub(super) fn note_broken(&self, partition: &str, st: &mut PartitionState, id: u64, promise: berth_core::Broken, lost_gpu_s: f64, credit_gpu_h: f64) -> bool {
        let Some(record) = st.jobs.get_mut(&id) else { return false };
        let owner = record.owner.clone();
        let what = match promise {
            berth_core::Broken::Outage { out_s } => format!("out of service {out_s} s, past its contract's maximum"),
            berth_core::Broken::PastCap => "stopped by the host past its daily interruption cap".to_string(),
            berth_core::Broken::GuaranteedStopped => "a guaranteed job stopped by the host".to_string(),
        };
        let note = format!("promise broken: {what}; {credit_gpu_h:.2} GPU-h credited to {}", crate::text::printable(&owner, 64));
        record.last_decision = if record.last_decision.is_empty() { note.clone() } else { format!("{}; {note}", record.last_decision) };
        tracing::warn!(target: "berth::serve", job = id, tenant = %owner, "{note}");
        st.credits.broken(&owner, lost_gpu_s, credit_gpu_h);
        self.credit_metrics(partition, &owner, credit_gpu_h, Some(promise));
        true
    }

    /// Counts a credit and a broken promise on /metrics.
    fn credit_metrics(&self, partition: &str, tenant: &str, credit_gpu_h: f64, broken: Option<berth_core::Broken>) {
        if credit_gpu_h > 0.0 {
            self.metrics.credit_gpu_hours.with_label_values(&[partition, tenant]).inc_by(credit_gpu_h);
        }
        if let Some(b) = broken {
            self.metrics.broken_promises.with_label_values(&[partition, tenant, b.name()]).inc();
        }
    }

    /// Sends running job `id` back to the queue with `detail`, to run again
    /// awake once its processes are gone: with a `notice`, a checkpoint
    /// notice now and the stop when it runs out (the priority contract);
    /// without, the stop now (a wake that could not get its GPUs back).
    /// The job's record (with `ops`) is stored before any notice or stop
    /// goes out, its stop deadline with it.
    pub(super) fn send_back(&self, part: &Partition, st: &mut PartitionState, id: u64, detail: String, notice: Option<Duration>, mut ops: Vec<crate::store::Op>) {
        let stop_at = self.clock.now() + notice.unwrap_or_default();
        let stop_at_unix_ms = self.now_ms() + notice.unwrap_or_default().as_millis() as u64;
        let Some(record) = st.jobs.get_mut(&id) else { return };
        if let Some(t) = record.ends_at.take() {
            st.running.remove(&(t, id));
        }
        record.close_run(self.now_ms());
        record.state = JobState::Pending;
        record.allocations.clear();
        record.placements.clear();
        record.interruptions += 1;
        record.interrupted_s.push(self.now_s());
        if record.interrupted_s.len() > super::state::KEPT_INTERRUPTIONS {
            record.interrupted_s.remove(0);
        }
        // A job asleep when sent back (its wake failed) keeps saying so
        // until its frozen processes are gone: their GPUs were lent, so
        // they hold nothing, and a restart gives them no drain.
        let asleep = record.sleep.frozen() && !record.spec.argv.is_empty();
        record.sleep = if asleep { super::state::SleepState::Asleep } else { super::state::SleepState::Awake };
        record.last_decision = detail.clone();
        record.detail = detail;
        if record.spec.argv.is_empty() {
            record.runs.clear();
        } else {
            record.evicting = true;
            for r in record.runs.iter_mut().filter(|r| r.holds) {
                r.stop_at_unix_ms = stop_at_unix_ms;
            }
        }
        ops.push(st.job_op(&part.name, id));
        // Acted on even when the write failed: the engine already gave its
        // GPUs away (they drain until its processes are gone), and a host
        // that restarts without the record stops them as orphans.
        self.persist_logged(ops);
        let record = &st.jobs[&id];
        if !record.spec.argv.is_empty() {
            let act = self.actuator();
            for r in record.runs.iter().filter(|r| r.holds) {
                match (&act, notice) {
                    (Some(act), Some(_)) => act.checkpoint(r.alloc_id, &r.node),
                    (Some(act), None) => {
                        act.stop(r.alloc_id, &r.node);
                    }
                    (None, _) => {}
                }
                if notice.is_some() {
                    st.stops.push((stop_at, r.alloc_id, r.node.clone()));
                }
            }
        }
        st.pending.push(id);
        self.metrics.jobs.with_label_values(&[&part.name, "running"]).dec();
        self.metrics.jobs.with_label_values(&[&part.name, "pending"]).inc();
    }

    /// The ledger's entry for an eviction that ended: how each of the job's
    /// tasks went from its stop to its exit, as measured.
    pub(crate) fn log_vacated(&self, part: &Partition, st: &PartitionState, id: u64) {
        let Some(job) = st.jobs.get(&id) else { return };
        // The tasks it was stopping whose exits were reported (a task lost
        // with its node, or one that had ended before, has no stop to time).
        let measured: Vec<&super::state::TaskRun> = job.runs.iter().filter(|r| r.stop_measured).collect();
        if measured.is_empty() {
            return;
        }
        let tasks = measured.len();
        let killed = measured.iter().filter(|r| r.killed).count();
        let slowest_ms = measured.iter().map(|r| r.stop_to_exit_ms).max().unwrap_or(0);
        self.decisions.append(DecisionRecord {
            id: 0,
            unix_ms: self.now_ms(),
            partition: part.name.clone(),
            job_id: id,
            actor: "agent".into(),
            arm: "rank".into(),
            actuated: true,
            policy: String::new(),
            policy_semver: String::new(),
            policy_version: 0,
            sha256: String::new(),
            input_digest: String::new(),
            outcome: "vacated".into(),
            detail: format!(
                "{tasks} task(s) gone, {killed} killed after the stop grace; timed by {}; slowest stop to exit {:.1} s",
                if measured.iter().all(|r| r.stop_timed_by_agent) { "the agent" } else { "the host" },
                slowest_ms as f64 / 1e3
            ),
            placements: Vec::new(),
            latency_us: 0,
        });
    }

    /// Every task of an evicted job has stopped: it may run again, and the
    /// jobs that waited for its GPUs start.
    pub(crate) fn vacated(&self, part: &Partition, st: &mut PartitionState, id: u64) {
        let Some(&slot) = st.slots.get(&id) else { return };
        st.engine.apply(&mut st.fleet, self.now_s(), berth_core::Event::Vacated(slot));
        if let Some(r) = st.jobs.get_mut(&id) {
            r.evicting = false;
            r.runs.clear();
            r.sleep = super::state::SleepState::Awake;
        }
        self.persist_logged(vec![st.job_op(&part.name, id)]);
        let ready: Vec<u64> = st
            .jobs
            .iter_mut()
            .filter(|(_, j)| j.state == JobState::Running && j.waiting_on.contains(&id))
            .filter_map(|(&jid, j)| {
                j.waiting_on.retain(|&v| v != id);
                j.waiting_on.is_empty().then_some(jid)
            })
            .collect();
        for jid in ready {
            let j = &st.jobs[&jid];
            if j.sleep == super::state::SleepState::Waking && !j.runs.is_empty() {
                tracing::info!(target: "berth::serve", job = jid, "borrowers are gone: waking");
                self.finish_wake(part, st, jid);
            } else {
                tracing::info!(target: "berth::serve", job = jid, "preempted work is gone: starting");
                self.actuate(part, st, jid);
            }
        }
        st.dirty = true;
        part.wake.notify_all();
    }
}

/// What a breaker trip did to the partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trip {
    None,
    /// The version is out of service; another decides (or the candidate is gone).
    Replaced,
    /// No good version to fall back to: decisions wait for an operator.
    Paused,
}
/// One arm's run on one job.
pub(super) struct ArmRun {
    pub result: Result<Option<(Vec<Allocation>, u32)>, PolicyError>,
    pub first: Option<(Vec<u32>, Vec<f64>)>,
    pub latency: Duration,
}
type Keep<'a> = &'a dyn Fn(NodeId, &Node) -> bool;
pub(super) fn run_arm(arm: &Arm, fleet: &mut Fleet, placer: &mut Placer, job: &Job, keep: Keep<'_>) -> ArmRun {
    let mut policy = arm.policy.lock().unwrap();
    let mut recording = Recording { inner: &mut *policy, first: None };
    let started = Instant::now();
    let mut placements = 0;
    let result = berth_core::sim::place_gang(fleet, placer, &mut recording, job, &mut placements, keep);
    ArmRun { latency: started.elapsed(), first: recording.first, result }
}
/// Nodes neither idle nor full: a measure of fragmentation.
pub(super) fn partly_used(fleet: &Fleet) -> u64 {
    fleet.nodes().iter().filter(|n| !n.gpus.is_empty() && n.gpu_free_milli() > 0 && n.gpu_free_milli() < n.gpu_total_milli()).count() as u64
}
/// SHA-256 (16 hex) of the job and the free capacity the policy sees.
pub(super) fn input_digest(fleet: &Fleet, job: &Job) -> String {
    let mut h = Sha256::new();
    let s = &job.shape;
    h.update(format!("{}|{}|{}|{}|{}|{}|{}|{:?}", job.id, job.priority, job.tasks, s.gpu_count, s.gpu_milli, s.cpu_milli, s.memory_mib, s.models));
    // The fleet's state digest is kept as it changes (O(1) here).
    h.update(fleet.state_digest().to_le_bytes());
    hex::encode(&h.finalize()[..8])
}
pub(super) fn placed(fleet: &Fleet, allocs: &[Allocation]) -> Vec<Placed> {
    allocs
        .iter()
        .map(|a| Placed {
            node: fleet.nodes()[a.node as usize].name.clone(),
            gpus: berth_core::fleet::gpus_of(a.gpus).map(|g| g as u32).collect(),
        })
        .collect()
}

impl Live {
    /// Records a shadow comparison of the two arms' decisions on one job.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn compare(&self, part: &Partition, job: &Job, active: &ArmRun, fleet: &Fleet, cand: &ArmRun, scratch: &Fleet, shadow_decision: u64) {
        let mut stats = part.place.stats.lock().unwrap();
        let (Ok(a), Ok(c)) = (&active.result, &cand.result) else {
            if cand.result.is_err() {
                stats.candidate_errors += 1;
            }
            return;
        };
        let agree = match (a, c) {
            (Some((x, _)), Some((y, _))) => x == y,
            (None, None) => true,
            _ => false,
        };
        let picks = a.as_ref().zip(c.as_ref()).map(|((x, _), (y, _))| (x[0].node, y[0].node));
        let sample = shadow::Sample {
            job_id: job.id,
            agree,
            candidate_gap: picks.and_then(|(ap, cp)| shadow::score_gap(&cand.first, cp, ap)),
            active_gap: picks.and_then(|(ap, cp)| shadow::score_gap(&active.first, ap, cp)),
            domains: a.as_ref().zip(c.as_ref()).filter(|_| job.tasks > 1).map(|((_, da), (_, dc))| (*da, *dc)),
            partial_after: (partly_used(fleet), partly_used(scratch)),
        };
        let diff = (!agree).then(|| shadow::Diff {
            decision_id: shadow_decision,
            job_id: job.id,
            active: a.as_ref().map(|(x, _)| placed(fleet, x)).unwrap_or_default(),
            candidate: c.as_ref().map(|(y, _)| placed(scratch, y)).unwrap_or_default(),
            note: match (a, c) {
                (Some(_), None) => "candidate found no room".into(),
                (None, Some(_)) => "active found no room".into(),
                _ => "different nodes or GPUs".into(),
            },
        });
        self.metrics.shadow_samples.with_label_values(&[part.name.as_str(), if agree { "true" } else { "false" }]).inc();
        stats.add_sample(sample, diff);
    }
    /// Logs one arm's decision and counts it; returns the decision id.
    pub(super) fn log(&self, base: &DecisionRecord, arm_name: &str, actuated: bool, arm: &Arm, run: &ArmRun, fleet: &Fleet) -> u64 {
        let (outcome, detail, placements) = match &run.result {
            Ok(Some((allocs, domains))) => ("placed", format!("{} task(s) in {domains} switch domain(s)", allocs.len()), placed(fleet, allocs)),
            Ok(None) => ("unplaced", "no room for every task now".to_string(), Vec::new()),
            Err(e) => ("error", e.to_string(), Vec::new()),
        };
        let m = &arm.meta;
        let version = m.version.to_string();
        self.metrics.decisions.with_label_values(&[&base.partition, &m.name, &version, arm_name, outcome]).inc();
        self.metrics.decision_seconds.with_label_values(&[&base.partition, &m.name, &version, arm_name]).observe(run.latency.as_secs_f64());
        self.decisions.append(DecisionRecord {
            arm: arm_name.into(),
            actuated,
            policy: m.name.clone(),
            policy_semver: m.semver.clone(),
            policy_version: m.version,
            sha256: m.sha256.clone(),
            outcome: outcome.into(),
            detail,
            placements,
            latency_us: run.latency.as_micros() as u64,
            ..base.clone()
        })
    }
    /// Feeds the breaker; on a trip, takes the version out of service.
    pub(super) fn after_call(&self, p: usize, arm: &Arc<Arm>, run: &ArmRun, is_active: bool) -> Trip {
        let part = &self.partitions[p];
        let v = arm.meta.version;
        let call = match &run.result {
            Ok(_) => breaker::Call::Answered(run.latency),
            Err(e) if breaker::counts(e) => {
                self.metrics.policy_failures.with_label_values(&[&part.name, &arm.meta.name, &v.to_string(), breaker::kind(e)]).inc();
                tracing::warn!(target: "berth::serve", partition = %part.name, version = v, "policy call failed: {e}");
                breaker::Call::Failed(e)
            }
            Err(_) => return Trip::None,
        };
        // Bound first: trip() takes the breaker's lock again.
        let tripped = part.place.breaker.lock().unwrap().record(v, call, &self.breaker);
        match tripped {
            None => Trip::None,
            Some(reason) => self.trip(p, arm, &reason, is_active),
        }
    }
}
