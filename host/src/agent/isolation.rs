//! What a task asked for, enforced on its node: each task runs in a cgroup
//! of its own (v2 where the agent's cgroup has the cpu and memory
//! controllers, v1 otherwise) with a CPU quota from its cores, a memory
//! limit from its memory request and the agent's CPU list as its CPU set;
//! the freezer puts it to sleep where there is one. Without cgroup access
//! the agent pins tasks to its CPU list with affinity (no quota, no limit)
//! and says so once at start.
//!
//! The cgroups read back what happened: CPU used and throttled, memory used
//! and its peak, and OOM kills; `/proc/pressure` gives the node's CPU,
//! memory and IO pressure.

use std::ffi::CString;
use std::fmt;
use std::path::{Path, PathBuf};

/// A CPU list as the kernel writes one (`0-3,6`), sorted, without repeats.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuList(Vec<u32>);

/// The most CPUs a list may name (the kernel's own ceiling is 8192).
const MAX_CPU: u32 = 8191;

impl CpuList {
    pub fn parse(text: &str) -> Result<CpuList, String> {
        let mut cpus = Vec::new();
        for part in text.trim().split(',').filter(|p| !p.is_empty()) {
            let num = |s: &str| s.trim().parse::<u32>().ok().filter(|&c| c <= MAX_CPU).ok_or_else(|| format!("CPU list {text:?}: {s:?} is not a CPU number (0-{MAX_CPU})"));
            let (lo, hi) = match part.split_once('-') {
                Some((a, b)) => (num(a)?, num(b)?),
                None => (num(part)?, num(part)?),
            };
            if lo > hi {
                return Err(format!("CPU list {text:?}: range {part:?} runs backwards"));
            }
            cpus.extend(lo..=hi);
        }
        cpus.sort_unstable();
        cpus.dedup();
        if cpus.is_empty() {
            return Err(format!("CPU list {text:?} names no CPU"));
        }
        Ok(CpuList(cpus))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn cpus(&self) -> &[u32] {
        &self.0
    }
}

impl fmt::Display for CpuList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut i = 0;
        while i < self.0.len() {
            let mut j = i;
            while j + 1 < self.0.len() && self.0[j + 1] == self.0[j] + 1 {
                j += 1;
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if i == j {
                write!(f, "{}", self.0[i])?;
            } else {
                write!(f, "{}-{}", self.0[i], self.0[j])?;
            }
            i = j + 1;
        }
        Ok(())
    }
}

/// How the agent may enforce what tasks asked for (`--isolation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// cgroups where the agent can write them, else CPU affinity.
    Auto,
    /// cgroups or refuse to start.
    Cgroup,
    /// CPU affinity to the agent's CPU list only (no quota, no limit).
    Affinity,
    /// Nothing: tasks run as the agent does.
    None,
}

/// A v1 controller the agent uses (cpu and memory are required).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Controller {
    Cpu,
    Cpuacct,
    Cpuset,
    Memory,
    Freezer,
}

impl Controller {
    const ALL: [Controller; 5] = [Controller::Cpu, Controller::Cpuacct, Controller::Cpuset, Controller::Memory, Controller::Freezer];

    fn name(self) -> &'static str {
        match self {
            Controller::Cpu => "cpu",
            Controller::Cpuacct => "cpuacct",
            Controller::Cpuset => "cpuset",
            Controller::Memory => "memory",
            Controller::Freezer => "freezer",
        }
    }
}

#[derive(Debug)]
enum Kind {
    /// The agent's group in the unified hierarchy.
    V2(PathBuf),
    /// The agent's group in each v1 hierarchy it found.
    V1(Vec<(Controller, PathBuf)>),
    Affinity,
    Nothing,
}

/// The agent's means of enforcement, found once at start.
#[derive(Debug)]
pub struct Isolation {
    kind: Kind,
    /// The node's CPUs (`--cpus`, else those the agent may run on).
    cpus: Option<CpuList>,
}

/// One task's cgroups (one per v1 hierarchy, or one in v2).
#[derive(Clone, Debug, Default)]
pub struct TaskGroup {
    dirs: Vec<(Option<&'static str>, PathBuf)>,
    v2: bool,
}

/// What a task's cgroup says it used.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    pub cpu_us: u64,
    pub throttled_us: u64,
    pub nr_throttled: u64,
    pub memory_bytes: u64,
    pub memory_peak_bytes: u64,
    pub oom_kills: u64,
}

/// A pressure file's `some` and `full` lines (PSI).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pressure {
    pub some_avg10: f32,
    pub some_avg60: f32,
    pub full_avg10: f32,
    pub some_total_us: u64,
}

impl Isolation {
    /// Finds what this agent can use for `mode`, creating its own group
    /// (`berth-<tag>`) under its cgroup in each hierarchy. `tag` names the
    /// agent instance (node and state folder), so two agents on one machine,
    /// or a test's many, never share a group, and a restarted agent finds
    /// the groups of the tasks it adopts.
    pub fn detect(mode: Mode, tag: &str, cpus: Option<CpuList>) -> Result<Isolation, String> {
        // A list beyond the CPUs this agent may use could confine nothing.
        if let (Some(asked), Some(own)) = (&cpus, own_affinity())
            && let Some(c) = asked.cpus().iter().find(|c| !own.cpus().contains(c))
        {
            return Err(format!("--cpus {asked}: CPU {c} is not one this agent may use ({own})"));
        }
        let cpus = cpus.or_else(own_affinity);
        let kind = match mode {
            Mode::None => Kind::Nothing,
            Mode::Affinity => Kind::Affinity,
            Mode::Auto | Mode::Cgroup => match cgroups(tag, cpus.as_ref()) {
                Ok(k) => k,
                Err(e) if mode == Mode::Cgroup => return Err(format!("--isolation cgroup: {e}")),
                Err(e) => {
                    eprintln!("berth agent: tasks' CPU and memory are not enforced ({e}); tasks are pinned to CPUs {} only", cpus.as_ref().map_or("(all)".into(), |c| c.to_string()));
                    Kind::Affinity
                }
            },
        };
        Ok(Isolation { kind, cpus })
    }

    /// One line on how tasks are confined.
    pub fn describe(&self) -> String {
        let cpus = self.cpus.as_ref().map_or("all".into(), |c| c.to_string());
        match &self.kind {
            Kind::V2(d) => format!("cgroup v2 under {} (CPUs {cpus})", d.display()),
            Kind::V1(g) => format!("cgroup v1 ({}; CPUs {cpus})", g.iter().map(|(c, _)| c.name()).collect::<Vec<_>>().join(", ")),
            Kind::Affinity => format!("CPU affinity only (CPUs {cpus})"),
            Kind::Nothing => "none".into(),
        }
    }

    /// Whether tasks run in cgroups (their use can be read).
    pub fn has_cgroups(&self) -> bool {
        matches!(self.kind, Kind::V1(_) | Kind::V2(_))
    }

    /// The short name reported to the host: "cgroup-v2", "cgroup-v1",
    /// "affinity" or "none".
    pub fn name(&self) -> &'static str {
        match self.kind {
            Kind::V2(_) => "cgroup-v2",
            Kind::V1(_) => "cgroup-v1",
            Kind::Affinity => "affinity",
            Kind::Nothing => "none",
        }
    }

    pub fn cpus(&self) -> Option<&CpuList> {
        self.cpus.as_ref()
    }

    /// The CPUs a task is pinned to by affinity (no cgroup confines it).
    pub fn affinity(&self) -> Option<&CpuList> {
        match self.kind {
            Kind::Affinity => self.cpus.as_ref(),
            _ => None,
        }
    }

    /// Task `alloc`'s group (not created).
    pub fn group(&self, alloc: u64) -> TaskGroup {
        let leaf = format!("alloc-{alloc}");
        match &self.kind {
            Kind::V2(d) => TaskGroup { dirs: vec![(None, d.join(leaf))], v2: true },
            Kind::V1(g) => TaskGroup { dirs: g.iter().map(|(c, d)| (Some(c.name()), d.join(&leaf))).collect(), v2: false },
            Kind::Affinity | Kind::Nothing => TaskGroup::default(),
        }
    }

    /// Creates task `alloc`'s group with its limits: `cpu_milli` thousandths
    /// of a core (0: no quota), `memory_mib` (0: no limit).
    pub fn create(&self, alloc: u64, cpu_milli: u32, memory_mib: u64) -> Result<TaskGroup, String> {
        let group = self.group(alloc);
        for (controller, dir) in &group.dirs {
            let parent = dir.parent().expect("a task group has a parent");
            match std::fs::create_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(format!("creating {}: {e}", dir.display())),
            }
            let cpu = controller.is_none() || *controller == Some("cpu");
            let memory = controller.is_none() || *controller == Some("memory");
            let cpuset = controller.is_none() || *controller == Some("cpuset");
            if cpu && cpu_milli > 0 {
                // A period of 100 ms; the kernel refuses quotas under 1 ms.
                let quota = (u64::from(cpu_milli) * 100).max(1000);
                if group.v2 {
                    write(dir, "cpu.max", &format!("{quota} 100000"))?;
                } else {
                    write(dir, "cpu.cfs_period_us", "100000")?;
                    write(dir, "cpu.cfs_quota_us", &quota.to_string())?;
                }
            }
            if memory && memory_mib > 0 {
                let bytes = memory_mib.saturating_mul(1 << 20);
                if group.v2 {
                    write(dir, "memory.max", &bytes.to_string())?;
                    // Over its limit a task is killed, not swapped out.
                    let _ = write(dir, "memory.swap.max", "0");
                } else {
                    write(dir, "memory.limit_in_bytes", &bytes.to_string())?;
                    let _ = write(dir, "memory.memsw.limit_in_bytes", &bytes.to_string());
                    let _ = write(dir, "memory.swappiness", "0");
                }
            }
            if cpuset && !group.v2 {
                // A v1 cpuset starts empty: it takes its parent's CPUs and
                // memory nodes (the agent's list).
                for file in ["cpuset.cpus", "cpuset.mems"] {
                    let value = read(parent, file).ok_or_else(|| format!("reading {}/{file}", parent.display()))?;
                    write(dir, file, value.trim())?;
                }
            }
        }
        Ok(group)
    }

    /// Removes task `alloc`'s group once its processes are gone; a process
    /// still in it (one that left its process group) is killed first.
    pub fn remove(&self, alloc: u64) {
        let group = self.group(alloc);
        for (_, dir) in &group.dirs {
            if !dir.exists() {
                continue;
            }
            if std::fs::remove_dir(dir).is_err() {
                group.kill_all();
                // The kernel lets a group go once its last process is reaped.
                for _ in 0..50 {
                    if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            }
        }
    }

    /// Groups of tasks this agent no longer runs (left by an agent that was
    /// killed before it could remove them): removed, except `keep`.
    pub fn remove_stale(&self, keep: &[u64]) {
        let dirs: Vec<&PathBuf> = match &self.kind {
            Kind::V2(d) => vec![d],
            Kind::V1(g) => g.iter().map(|(_, d)| d).collect(),
            _ => return,
        };
        let mut stale = std::collections::BTreeSet::new();
        for d in dirs {
            for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
                if let Some(id) = e.file_name().to_str().and_then(|n| n.strip_prefix("alloc-")).and_then(|n| n.parse::<u64>().ok())
                    && !keep.contains(&id)
                {
                    stale.insert(id);
                }
            }
        }
        for id in stale {
            self.remove(id);
        }
    }
}

impl TaskGroup {
    /// The files a process writes its pid to, to join the group.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|(_, d)| d.join("cgroup.procs")).collect()
    }

    fn dir(&self, controller: &str) -> Option<&Path> {
        self.dirs.iter().find(|(c, _)| c.is_none() || *c == Some(controller)).map(|(_, d)| d.as_path())
    }

    /// Freezes (or thaws) the group; Err when it has no freezer.
    pub fn freeze(&self, frozen: bool) -> Result<(), String> {
        let dir = self.dir("freezer").ok_or("no freezer")?;
        if self.v2 {
            write(dir, "cgroup.freeze", if frozen { "1" } else { "0" })
        } else {
            write(dir, "freezer.state", if frozen { "FROZEN" } else { "THAWED" })
        }
    }

    pub fn has_freezer(&self) -> bool {
        self.dir("freezer").is_some_and(|d| d.join(if self.v2 { "cgroup.freeze" } else { "freezer.state" }).exists())
    }

    /// Whether the kernel has finished freezing the group (v1 FREEZING is
    /// on the way, not there: some task may still run).
    pub fn frozen_through(&self) -> bool {
        match self.dir("freezer") {
            Some(d) if self.v2 => read(d, "cgroup.events").is_some_and(|s| s.lines().any(|l| l.trim() == "frozen 1")),
            Some(d) => read(d, "freezer.state").is_some_and(|s| s.trim() == "FROZEN"),
            None => false,
        }
    }

    /// Whether the group is frozen now.
    pub fn frozen(&self) -> bool {
        match self.dir("freezer") {
            Some(d) if self.v2 => read(d, "cgroup.freeze").is_some_and(|s| s.trim() == "1"),
            Some(d) => read(d, "freezer.state").is_some_and(|s| s.trim() != "THAWED"),
            None => false,
        }
    }

    /// SIGKILL to every process in the group (those that left the task's
    /// process group too); a frozen group is thawed so the kill lands.
    pub fn kill_all(&self) {
        if let Some(d) = self.dirs.first().map(|(_, d)| d)
            && self.v2
            && write(d, "cgroup.kill", "1").is_ok()
        {
            return;
        }
        for (_, d) in &self.dirs {
            for pid in read(d, "cgroup.procs").unwrap_or_default().lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                // SAFETY: kill(2) on a pid read from the task's own group.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let _ = self.freeze(false);
    }

    /// What the group used so far (zeros where a file is missing).
    pub fn usage(&self) -> Usage {
        let mut u = Usage::default();
        if self.v2 {
            let Some(d) = self.dirs.first().map(|(_, d)| d) else { return u };
            let stat = read(d, "cpu.stat").unwrap_or_default();
            u.cpu_us = keyed(&stat, "usage_usec");
            u.throttled_us = keyed(&stat, "throttled_usec");
            u.nr_throttled = keyed(&stat, "nr_throttled");
            u.memory_bytes = read(d, "memory.current").and_then(|s| s.trim().parse().ok()).unwrap_or(0);
            u.memory_peak_bytes = read(d, "memory.peak").and_then(|s| s.trim().parse().ok()).unwrap_or(u.memory_bytes);
            u.oom_kills = keyed(&read(d, "memory.events").unwrap_or_default(), "oom_kill");
            return u;
        }
        if let Some(d) = self.dir("cpuacct") {
            u.cpu_us = read(d, "cpuacct.usage").and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0) / 1000;
        }
        if let Some(d) = self.dir("cpu") {
            let stat = read(d, "cpu.stat").unwrap_or_default();
            u.throttled_us = keyed(&stat, "throttled_time") / 1000;
            u.nr_throttled = keyed(&stat, "nr_throttled");
        }
        if let Some(d) = self.dir("memory") {
            u.memory_bytes = read(d, "memory.usage_in_bytes").and_then(|s| s.trim().parse().ok()).unwrap_or(0);
            u.memory_peak_bytes = read(d, "memory.max_usage_in_bytes").and_then(|s| s.trim().parse().ok()).unwrap_or(0);
            u.oom_kills = keyed(&read(d, "memory.oom_control").unwrap_or_default(), "oom_kill");
        }
        u
    }
}

/// The node's pressure (PSI) for "cpu", "memory" or "io"; None where the
/// kernel has none.
pub fn pressure(resource: &str) -> Option<Pressure> {
    let text = std::fs::read_to_string(format!("/proc/pressure/{resource}")).ok()?;
    Some(parse_pressure(&text))
}

fn parse_pressure(text: &str) -> Pressure {
    let mut p = Pressure::default();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let which = words.next();
        let field = |name: &str| line.split_whitespace().find_map(|w| w.strip_prefix(name).and_then(|v| v.strip_prefix('=')));
        let avg = |name: &str| field(name).and_then(|v| v.parse::<f32>().ok()).filter(|v| v.is_finite()).unwrap_or(0.0);
        match which {
            Some("some") => {
                p.some_avg10 = avg("avg10");
                p.some_avg60 = avg("avg60");
                p.some_total_us = field("total").and_then(|v| v.parse().ok()).unwrap_or(0);
            }
            Some("full") => p.full_avg10 = avg("avg10"),
            _ => {}
        }
    }
    p
}

/// `key value` lines (cpu.stat, memory.events, memory.oom_control).
fn keyed(text: &str, key: &str) -> u64 {
    text.lines().find_map(|l| l.strip_prefix(key).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok())).unwrap_or(0)
}

fn read(dir: &Path, file: &str) -> Option<String> {
    std::fs::read_to_string(dir.join(file)).ok()
}

fn write(dir: &Path, file: &str, value: &str) -> Result<(), String> {
    std::fs::write(dir.join(file), value).map_err(|e| format!("writing {value:?} to {}: {e}", dir.join(file).display()))
}

/// The CPUs this process may run on.
fn own_affinity() -> Option<CpuList> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    CpuList::parse(list.trim()).ok()
}

/// A line of /proc/self/mountinfo: mount point, the mount's root, its
/// filesystem type and super options.
struct Mount {
    point: PathBuf,
    root: String,
    fstype: String,
    options: String,
}

fn mounts() -> Vec<Mount> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let left: Vec<&str> = left.split_whitespace().collect();
            let mut right = right.split_whitespace();
            let fstype = right.next()?.to_string();
            let _source = right.next();
            let options = right.next().unwrap_or("").to_string();
            Some(Mount { point: PathBuf::from(unescape(left.get(4)?)), root: unescape(left.get(3)?), fstype, options })
        })
        .collect()
}

/// mountinfo escapes spaces and the like as octal (`\040`).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && b.get(i + 1..i + 4).is_some_and(|d| d.iter().all(|c| (b'0'..=b'7').contains(c))) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// This process's cgroup path per hierarchy (/proc/self/cgroup): the v2
/// path under "", v1 paths under each controller name.
fn own_cgroups() -> Vec<(String, String)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut out = Vec::new();
    for l in text.lines() {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        if controllers.is_empty() {
            out.push((String::new(), path.to_string()));
        } else {
            for c in controllers.split(',') {
                out.push((c.to_string(), path.to_string()));
            }
        }
    }
    out
}

/// `point` + `path` seen from a mount whose root is `root`.
fn under_mount(point: &Path, root: &str, path: &str) -> PathBuf {
    let rel = path.strip_prefix(root).unwrap_or(path).trim_start_matches('/');
    if rel.is_empty() { point.to_path_buf() } else { point.join(rel) }
}

fn cgroups(tag: &str, cpus: Option<&CpuList>) -> Result<Kind, String> {
    let mounts = mounts();
    let own = own_cgroups();
    let path_of = |controller: &str| own.iter().find(|(c, _)| c == controller).map(|(_, p)| p.clone());
    let group_name = format!("berth-{tag}");
    // v2 first, where it has what the agent needs.
    if let Some(m) = mounts.iter().find(|m| m.fstype == "cgroup2")
        && let Some(path) = path_of("")
    {
        let base = under_mount(&m.point, &m.root, &path);
        let controllers = read(&base, "cgroup.controllers").unwrap_or_default();
        let has = |c: &str| controllers.split_whitespace().any(|x| x == c);
        if has("cpu") && has("memory") {
            return v2_group(&base, &group_name, has("cpuset"), cpus).map(Kind::V2);
        }
    }
    let mut groups = Vec::new();
    let mut missing = Vec::new();
    for c in Controller::ALL {
        let mount = mounts.iter().find(|m| m.fstype == "cgroup" && m.options.split(',').any(|o| o == c.name()));
        let (Some(m), Some(path)) = (mount, path_of(c.name())) else {
            missing.push(c.name());
            continue;
        };
        let dir = under_mount(&m.point, &m.root, &path).join(&group_name);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                if matches!(c, Controller::Cpu | Controller::Memory) {
                    return Err(format!("creating {}: {e}", dir.display()));
                }
                missing.push(c.name());
                continue;
            }
        }
        if c == Controller::Cpuset {
            let parent = dir.parent().expect("has a parent");
            let cpus_value = match cpus {
                Some(list) => list.to_string(),
                None => read(parent, "cpuset.cpus").unwrap_or_default().trim().to_string(),
            };
            let mems = read(parent, "cpuset.mems").unwrap_or_default().trim().to_string();
            if let Err(e) = write(&dir, "cpuset.cpus", &cpus_value).and_then(|()| write(&dir, "cpuset.mems", &mems)) {
                return Err(format!("the agent's CPU set: {e}"));
            }
        }
        groups.push((c, dir));
    }
    if !groups.iter().any(|(c, _)| *c == Controller::Cpu) || !groups.iter().any(|(c, _)| *c == Controller::Memory) {
        return Err(format!("no writable cgroup v1 cpu and memory hierarchies, and no cgroup v2 with those controllers (missing: {})", missing.join(", ")));
    }
    Ok(Kind::V1(groups))
}

/// The agent's group in the unified hierarchy, with the controllers its
/// tasks need enabled below it.
fn v2_group(base: &Path, name: &str, cpuset: bool, cpus: Option<&CpuList>) -> Result<PathBuf, String> {
    let wanted = if cpuset { "+cpu +memory +cpuset" } else { "+cpu +memory" };
    if write(base, "cgroup.subtree_control", wanted).is_err() {
        // A group holding processes cannot enable controllers for its
        // children (the "no internal processes" rule): the agent moves into
        // a leaf of its own first.
        let leaf = base.join(format!("{name}-agent"));
        let _ = std::fs::create_dir(&leaf);
        write(&leaf, "cgroup.procs", &std::process::id().to_string())?;
        write(base, "cgroup.subtree_control", wanted).map_err(|e| format!("{e} (other processes share the agent's cgroup: give it a delegated one)"))?;
    }
    let dir = base.join(name);
    match std::fs::create_dir(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("creating {}: {e}", dir.display())),
    }
    if let Some(list) = cpus.filter(|_| cpuset) {
        write(&dir, "cpuset.cpus", &list.to_string())?;
    }
    write(&dir, "cgroup.subtree_control", wanted)?;
    Ok(dir)
}

/// Runs in the forked child before exec (the supervisor's task): joins the
/// task's groups and sets its CPU affinity. Only async-signal-safe calls.
pub struct Confine {
    procs: Vec<CString>,
    affinity: Option<libc::cpu_set_t>,
}

impl Confine {
    pub fn new(procs: &[PathBuf], affinity: Option<&CpuList>) -> Result<Confine, String> {
        use std::os::unix::ffi::OsStrExt;
        let procs = procs.iter().map(|p| CString::new(p.as_os_str().as_bytes()).map_err(|_| format!("{}: a NUL in the path", p.display()))).collect::<Result<_, _>>()?;
        let affinity = affinity.map(|list| {
            // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET bounds
            // its index by the set's size.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            for &c in list.cpus() {
                if (c as usize) < libc::CPU_SETSIZE as usize {
                    unsafe { libc::CPU_SET(c as usize, &mut set) };
                }
            }
            set
        });
        Ok(Confine { procs, affinity })
    }

    /// Called between fork and exec.
    pub fn apply(&self) -> std::io::Result<()> {
        // SAFETY: getpid, open, write, close and sched_setaffinity are
        // async-signal-safe; the buffers were made before the fork.
        let pid = unsafe { libc::getpid() };
        let mut buf = [0u8; 12];
        let text = itoa(pid as u32, &mut buf);
        for path in &self.procs {
            let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let n = unsafe { libc::write(fd, text.as_ptr().cast(), text.len()) };
            let err = std::io::Error::last_os_error();
            unsafe { libc::close(fd) };
            if n != text.len() as isize {
                return Err(err);
            }
        }
        if let Some(set) = &self.affinity
            && unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) } != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Decimal digits of `n` in `buf`, without allocating.
fn itoa(mut n: u32, buf: &mut [u8; 12]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[i..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_print_as_the_kernel_writes_them() {
        let l = CpuList::parse("6,0-3,2").unwrap();
        assert_eq!(l.cpus(), &[0, 1, 2, 3, 6]);
        assert_eq!(l.to_string(), "0-3,6");
        assert_eq!(CpuList::parse("5").unwrap().to_string(), "5");
        for bad in ["", "3-1", "x", "0-99999", ","] {
            assert!(CpuList::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn pressure_and_keyed_files_are_read_as_the_kernel_writes_them() {
        let p = parse_pressure("some avg10=1.50 avg60=0.25 avg300=0.00 total=12345\nfull avg10=0.75 avg60=0.00 avg300=0.00 total=99\n");
        assert_eq!(p, Pressure { some_avg10: 1.5, some_avg60: 0.25, full_avg10: 0.75, some_total_us: 12345 });
        assert_eq!(keyed("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n", "oom_kill"), 2);
        assert_eq!(keyed("nr_periods 10\nnr_throttled 4\nthrottled_time 5000\n", "nr_throttled"), 4);
        let mut buf = [0u8; 12];
        assert_eq!(itoa(0, &mut buf), b"0");
        assert_eq!(itoa(4_294_967_295, &mut buf), b"4294967295");
        assert_eq!(unescape("/a\\040b"), "/a b");
        assert_eq!(under_mount(Path::new("/sys/fs/cgroup/memory"), "/", "/x/y"), PathBuf::from("/sys/fs/cgroup/memory/x/y"));
        assert_eq!(under_mount(Path::new("/sys/fs/cgroup"), "/x", "/x/y"), PathBuf::from("/sys/fs/cgroup/y"));
    }
}
