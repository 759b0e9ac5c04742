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
/// tasks (heartbeats, the node sweeper, other callers) to a fresh thread,
/// so a long pass cannot make live agents look silent.
pub fn may_block<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}
