//! What callers may send, in sizes and counts: the limits on a job spec
//! and a task command, checked in one place for the API and the agent hub
//! (INVALID_ARGUMENT past them, naming the field), and what one reply may
//! hold. docs/src/security.md lists them.

/// Bytes of a job's argv, env (names and values) and name together.
pub const JOB_SPEC_BYTES: usize = 64 << 10;
/// Arguments of a job's argv.
pub const ARGV: usize = 1024;
/// Variables of a job's env.
pub const ENV: usize = 256;
/// Bytes of a job's name.
pub const JOB_NAME_BYTES: usize = 256;
/// GPU models a job may accept.
pub const MODELS: usize = 64;
/// Priority a tenant may give a job where the access file sets no
/// ceiling for the partition; operators are not capped.
pub const TENANT_PRIORITY: u32 = 100;
/// Bytes of one list reply (jobs, decisions): under gRPC's default 4 MiB
/// receive limit, so every client can read it. A longer list is cut.
pub const REPLY_BYTES: usize = 3 << 20;

/// Bounds of a manual allocation's command (`StartAllocation`): those of a
/// job's argv and env.
pub fn check_task_command(argv: &[String], env: &std::collections::HashMap<String, String>) -> Result<(), String> {
    if argv.first().is_none_or(|a| a.is_empty()) {
        return Err("argv is empty, or argv[0] is".into());
    }
    if argv.len() > ARGV {
        return Err(format!("argv has {} arguments: at most {}", argv.len(), ARGV));
    }
    if env.len() > ENV {
        return Err(format!("env has {} variables: at most {}", env.len(), ENV));
    }
    let total = argv.iter().map(|a| a.len() + 1).sum::<usize>() + env.iter().map(|(k, v)| k.len() + v.len() + 2).sum::<usize>();
    if total > JOB_SPEC_BYTES {
        return Err(format!("argv and env are {total} bytes: at most {}", JOB_SPEC_BYTES));
    }
    if let Some(k) = env.keys().find(|k| k.is_empty() || k.contains('=') || k.contains('\0')) {
        return Err(format!("env name \"{}\" is empty or contains '=' or NUL", crate::text::printable(k, 64)));
    }
    Ok(())
}
/// The largest opportunistic budget one job may buy, in GPU-hours (a
/// thousand GPUs for a year, about).
pub const MAX_BUDGET_GPU_H: f64 = 1.0e7;
