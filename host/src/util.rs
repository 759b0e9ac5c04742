//! Small helpers the host and the node agent both use.

use std::path::Path;

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Writes `bytes` to `path` so that a reader sees the old file or the new
/// one, never half of one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Runs `f`, which may wait on a partition's lock (held through a whole
/// scheduling pass: policy calls, store writes), without stalling the async
/// runtime: on a multi-thread runtime the worker first hands its other
/// tasks (heartbeats, the node sweeper, other callers) to a fresh thread.
/// For rare calls only (a node back, the sweeper): each takes a thread of
/// the blocking pool while it waits; an API call's work goes to
/// [`off_worker`].
pub fn may_block<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Runs `f`, an API call's work that may wait on a partition's lock (held
/// through a whole pass), on the runtime's blocking pool, never on an async
/// worker. Waiting in place ([`may_block`]) hands the worker's other tasks
/// to a new thread per call: a long pass with thousands of agents' reports
/// behind it used up the runtime's blocking threads (512), no worker was
/// left to answer heartbeats, and at 20,000 nodes thousands of live nodes
/// were taken for lost. Here, calls beyond the pool wait in its queue while
/// the workers go on answering.
pub async fn off_worker<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => panic!("an API call's work was cancelled: {e}"),
        },
    }
}
