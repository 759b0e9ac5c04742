//! The `berth` command's manners, as a shell or a script sees them: quiet
//! and successful when the reader of its output goes away, and an exit
//! status that tells a wrong command line, a refusal and an outage apart.

use std::io::Read;
use std::process::{Command, Stdio};

use crate::agent::{dir, serve, BERTH};
use crate::common::repo_root;

/// `berth ARGS`, its stdout a pipe whose reader is gone before anything is
/// written: (exit status, stderr).
fn into_a_closed_pipe(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(BERTH)
        .args(args)
        .current_dir(repo_root())
        .env_remove("BERTH_TOKEN")
        .env_remove("BERTH_SERVER")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning berth");
    drop(child.stdout.take());
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    (child.wait().unwrap().code(), stderr)
}

/// `berth ARGS` run to its end: (exit status, stderr).
fn status_of(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(BERTH).args(args).current_dir(repo_root()).env_remove("BERTH_TOKEN").env_remove("BERTH_SERVER").stdin(Stdio::null()).output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_pipe_is_quiet_and_exit_statuses_tell_usage_refusal_and_outage_apart() {
    // A listing into a reader that went away (`berth policy list | head`):
    // status 0 and nothing on stderr (it was a panic with a backtrace).
    let (code, stderr) = into_a_closed_pipe(&["policy", "list"]);
    assert_eq!((code, stderr.as_str()), (Some(0), ""), "berth policy list into a closed pipe");

    // A wrong command line: 2.
    let (code, stderr) = status_of(&["jobs", "--no-such-flag"]);
    assert_eq!(code, Some(2), "{stderr}");

    // Nobody listening: 4, and the message says what was tried.
    let (code, stderr) = status_of(&["jobs", "--server", "http://127.0.0.1:1"]);
    assert_eq!(code, Some(4), "{stderr}");
    assert!(stderr.contains("127.0.0.1:1"), "{stderr}");

    // A real host: the same listing into a closed pipe is quiet; a request
    // it refuses (an unknown job; a viewer cancelling) is 3, with the
    // server's reason.
    let d = dir("cli");
    let (_host, url) = serve(&d, "host", &d.join("state"), &[]).await;
    let (code, stderr) = into_a_closed_pipe(&["jobs", "--server", &url, "--token", "ops-test-token"]);
    assert_eq!((code, stderr.as_str()), (Some(0), ""), "berth jobs into a closed pipe");
    let (code, stderr) = status_of(&["cancel", "424242", "--server", &url, "--token", "ops-test-token"]);
    assert_eq!(code, Some(3), "{stderr}");
    assert!(stderr.contains("424242"), "{stderr}");
    let (code, stderr) = status_of(&["jobs", "--server", &url, "--token", "no-such-token"]);
    assert_eq!(code, Some(3), "{stderr}");
    assert!(stderr.contains("Unauthenticated"), "{stderr}");
    // And a good request still succeeds.
    let (code, stderr) = status_of(&["jobs", "--server", &url, "--token", "ops-test-token"]);
    assert_eq!(code, Some(0), "{stderr}");
}

/// A `berth` installed elsewhere finds its bundled policies, run from any
/// folder: beside it in `<prefix>/share/berth/policies` (where
/// scripts/install.sh puts them), else in the checkout it was built from;
/// `berth policy list` says which.
#[test]
fn an_installed_berth_finds_its_policies_from_any_folder_and_says_where() {
    let d = dir("installed");
    let prefix = d.join("prefix");
    let shared = prefix.join("share/berth/policies");
    std::fs::create_dir_all(prefix.join("bin")).unwrap();
    std::fs::create_dir_all(&shared).unwrap();
    std::fs::copy(BERTH, prefix.join("bin/berth")).unwrap();
    for name in ["binpack", "best-fit"] {
        std::fs::copy(repo_root().join(format!("target/policies/{name}.wasm")), shared.join(format!("{name}.wasm"))).unwrap();
    }
    let elsewhere = d.join("work");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let run = |berth: &std::path::Path, args: &[&str]| {
        let out = Command::new(berth).args(args).current_dir(&elsewhere).env_remove("BERTH_POLICY_DIR").stdin(Stdio::null()).output().unwrap();
        assert!(out.status.success(), "{} {args:?}: {}", berth.display(), String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let listed = run(&prefix.join("bin/berth"), &["policy", "list"]);
    let mut lines = listed.lines();
    let head = lines.next().unwrap();
    assert!(head.contains("installed beside the binary") && head.contains("share/berth/policies"), "{listed}");
    assert_eq!(lines.map(str::trim).collect::<Vec<_>>(), ["best-fit", "binpack"], "{listed}");
    // And it decides with them: the demo's replay of best-fit.
    let demo = run(&prefix.join("bin/berth"), &["demo", "--nodes", "16", "--policy", "best-fit"]);
    assert!(demo.lines().any(|l| l.starts_with("best-fit")), "{demo}");

    // A binary with nothing beside it: the checkout it was built from.
    std::fs::copy(BERTH, elsewhere.join("berth")).unwrap();
    let listed = run(&elsewhere.join("berth"), &["policy", "list"]);
    let head = listed.lines().next().unwrap();
    assert!(head.contains("the checkout the binary was built from"), "{listed}");
    assert!(listed.lines().any(|l| l.trim() == "binpack"), "{listed}");
    let _ = std::fs::remove_dir_all(&d);
}
