//! The book under docs/ and README.md: every `{{#include}}` names a file
//! and anchor that exist (mdbook itself only warns, or includes nothing,
//! when they do not), README.md stays short and its links resolve.

use std::path::{Path, PathBuf};

use crate::common::repo_root;

/// `(target, anchor)` of every `{{#include target[:anchor]}}` in `text`.
fn includes(text: &str) -> Vec<(String, Option<String>)> {
    text.match_indices("{{#include ")
        .map(|(i, m)| {
            let rest = &text[i + m.len()..];
            let spec = rest[..rest.find("}}").expect("an include is closed with }}")].trim();
            match spec.split_once(':') {
                Some((path, anchor)) => (path.to_string(), Some(anchor.to_string())),
                None => (spec.to_string(), None),
            }
        })
        .collect()
}

pub(crate) fn book_pages() -> Vec<PathBuf> {
    let dir = repo_root().join("docs/src");
    let mut pages: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    pages
}

#[test]
fn every_book_include_names_an_existing_file_and_anchor() {
    let mut checked = 0;
    for page in book_pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for (target, anchor) in includes(&text) {
            let file = page.parent().unwrap().join(&target);
            let source = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("{}: includes {target}: {e}", page.display()));
            if let Some(anchor) = anchor {
                let (start, end) = (format!("ANCHOR: {anchor}"), format!("ANCHOR_END: {anchor}"));
                let from = source.find(&start).unwrap_or_else(|| panic!("{}: {target} has no `{start}`", page.display()));
                let to = source.find(&end).unwrap_or_else(|| panic!("{}: {target} has no `{end}`", page.display()));
                let body = &source[from + start.len()..to];
                assert!(body.lines().filter(|l| !l.trim().is_empty()).count() > 1, "{}: anchor {anchor} of {target} is empty", page.display());
            }
            checked += 1;
        }
    }
    // The contract, the FGD table, the Rust template and binpack, and the
    // three other languages' templates.
    assert!(checked >= 7, "{checked} includes found");
}

/// Chapters named in SUMMARY.md (mdbook fails the build when one is
/// missing: `create-missing = false`).
/// The lines of the `sh` blocks of README.md's tour, as written.
fn tour_sh_lines() -> Vec<String> {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let tour = readme.split("## A five-minute tour").nth(1).and_then(|t| t.split("\n## ").next()).expect("README.md has its tour");
    let mut in_sh = false;
    let mut out = Vec::new();
    for line in tour.lines() {
        if let Some(lang) = line.trim_start().strip_prefix("```") {
            in_sh = !in_sh && lang.trim() == "sh";
        } else if in_sh {
            out.push(line.to_string());
        }
    }
    out
}

/// `./scripts/demo.sh` alone readies the README's tour: it builds every
/// Rust policy, and every bundled policy the tour names (and the host's
/// default, binpack) is a Rust one. (It built only the six it replays, and
/// the tour's host stopped at once: no policy named binpack.)
#[test]
fn the_demo_builds_every_policy_the_tour_names() {
    let demo = std::fs::read_to_string(repo_root().join("scripts/demo.sh")).unwrap();
    assert!(demo.lines().any(|l| l.trim_start().starts_with("bash scripts/build-policies.sh --rust-only")), "demo.sh no longer builds every Rust policy");
    let mut named = vec!["binpack".to_string()];
    for line in tour_sh_lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        for (i, w) in words.iter().enumerate() {
            let next = words.get(i + 1).copied().unwrap_or("");
            // `--policy X`, `--preempt X`, and the component of `policy upload`.
            if matches!(*w, "--policy" | "--preempt") {
                named.push(next.to_string());
            }
            if *w == "upload" {
                let rest: Vec<&str> = words[i + 1..].iter().copied().take_while(|a| *a != "&&").collect();
                let mut k = 0;
                while k < rest.len() {
                    if rest[k].starts_with("--") {
                        k += 2;
                    } else {
                        named.push(rest[k].to_string());
                        break;
                    }
                }
            }
        }
    }
    let bundled: Vec<&String> = named.iter().filter(|n| !n.contains('/') && !n.ends_with(".wasm")).collect();
    assert!(bundled.len() >= 6, "only {bundled:?} found in the tour");
    for name in bundled {
        assert!(repo_root().join("policies").join(name).join("Cargo.toml").is_file(), "the tour names {name:?}, which is not a Rust policy demo.sh builds");
    }
}

/// Every relative link of the book names a chapter of the book: a link to
/// a file elsewhere in the repository (`../../wit/...`) works on a source
/// browser and is a dead link in the built book.
#[test]
fn book_links_stay_inside_the_book() {
    let link = |text: &str| -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = text;
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            if let Some(end) = rest.find(')') {
                out.push(rest[..end].to_string());
            }
        }
        out
    };
    let dir = repo_root().join("docs/src");
    let mut bad = Vec::new();
    for page in book_pages() {
        for target in link(&std::fs::read_to_string(&page).unwrap()) {
            if target.starts_with("http://") || target.starts_with("https://") || target.starts_with('#') || target.starts_with("mailto:") {
                continue;
            }
            let file = target.split('#').next().unwrap();
            if !(file.ends_with(".md") && !file.contains('/') && dir.join(file).is_file()) {
                bad.push(format!("{}: {target}", page.file_name().unwrap().to_string_lossy()));
            }
        }
    }
    assert!(bad.is_empty(), "links that leave the book (name the path as code instead):\n{}", bad.join("\n"));
}

fn summary_chapters() -> Vec<String> {
    let text = std::fs::read_to_string(repo_root().join("docs/src/SUMMARY.md")).unwrap();
    text.match_indices("](").map(|(i, _)| text[i + 2..].split(')').next().unwrap().to_string()).collect()
}

#[test]
fn readme_is_short_and_links_into_the_book() {
    let root = repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(readme.len() < 12 * 1024, "README.md is {} bytes; the manual belongs in docs/", readme.len());
    let chapters = summary_chapters();
    let mut into_book = 0;
    for (i, _) in readme.match_indices("](") {
        let target = readme[i + 2..].split(')').next().unwrap();
        if target.starts_with("http") || target.starts_with('#') {
            continue;
        }
        let path = target.split('#').next().unwrap();
        let in_summary = path.strip_prefix("docs/src/").is_some_and(|p| chapters.iter().any(|c| c == p));
        assert!(root.join(path).exists() || in_summary, "README.md links to {target}, which does not exist");
        if path.starts_with("docs/src/") {
            assert!(in_summary || Path::new(path).ends_with("SUMMARY.md"), "README.md links to {path}, not a chapter of the book");
            into_book += 1;
        }
    }
    assert!(into_book >= 10, "README.md links to {into_book} chapters");
}

/// The host side (`serve/`) and the node agent (`agent/`) share only the
/// generated protocol (`proto`) and small helpers (`util`), never each
/// other's modules: no file cycle between them.
#[test]
fn serve_and_agent_do_not_import_each_other() {
    let src = crate::common::repo_root().join("host/src");
    for (dir, forbidden) in [("agent", ["crate::serve", "super::super::serve"]), ("serve", ["crate::agent", "super::super::agent"])] {
        let mut files = 0;
        for entry in std::fs::read_dir(src.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "rs") {
                files += 1;
                let text = std::fs::read_to_string(&path).unwrap();
                for f in forbidden {
                    assert!(!text.contains(f), "{} uses {f}", path.display());
                }
            }
        }
        assert!(files > 2, "host/src/{dir} has its modules");
    }
}

/// The `berth ...` commands of the command blocks of README.md and the
/// book (`sh` blocks, and `$ berth` lines of session transcripts), with
/// continuation lines joined and comments dropped: (page:line, arguments
/// as the shell would see them). Synopses (`[--flag]`, `a|b`, `<name>`,
/// `...`) are left out: they are not command lines.
fn book_commands() -> (Vec<(String, String)>, usize) {
    let mut pages = book_pages();
    pages.insert(0, repo_root().join("README.md"));
    let (mut commands, mut synopses) = (Vec::new(), 0);
    for page in pages {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page.file_name().unwrap().to_string_lossy().into_owned();
        let (mut fence, mut joined, mut first) = (None::<String>, String::new(), 0);
        for (n, line) in text.lines().enumerate() {
            if let Some(lang) = line.trim_start().strip_prefix("```") {
                fence = if fence.is_some() { None } else { Some(lang.trim().to_string()) };
                continue;
            }
            let Some(lang) = &fence else { continue };
            let line = if lang == "sh" { line } else if let Some(l) = line.strip_prefix("$ ") { l } else { continue };
            if joined.is_empty() {
                first = n + 1;
            }
            match line.strip_suffix('\\') {
                Some(part) => {
                    joined.push_str(part);
                    joined.push(' ');
                    continue;
                }
                None => joined.push_str(line),
            }
            let whole = std::mem::take(&mut joined);
            // A comment starts at a `#` after a space (none is quoted here).
            let code = match whole.find(" #") {
                Some(i) => &whole[..i],
                None => whole.as_str(),
            };
            for segment in shell_commands(code) {
                let segment = segment.trim().trim_start_matches('(').trim_end_matches(')').trim().trim_end_matches('&').trim();
                let Some(args) = segment.strip_prefix("berth ").or_else(|| segment.strip_prefix("./target/release/berth ")) else { continue };
                if args.contains(['[', ']', '<', '>', '|']) || args.contains("...") {
                    synopses += 1;
                    continue;
                }
                commands.push((format!("{name}:{first}"), args.to_string()));
            }
        }
    }
    (commands, synopses)
}

/// The commands of a shell line: split at `&&`, `;` and ` | ` outside
/// quotes.
fn shell_commands(line: &str) -> Vec<String> {
    let (mut out, mut current, mut quote) = (Vec::new(), String::new(), None::<char>);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (None, '\'' | '"') => quote = Some(c),
            (None, ';') => {
                out.push(std::mem::take(&mut current));
                continue;
            }
            (None, '&') if chars.peek() == Some(&'&') => {
                chars.next();
                out.push(std::mem::take(&mut current));
                continue;
            }
            (None, '|') if current.ends_with(' ') && chars.peek() == Some(&' ') => {
                out.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    out.push(current);
    out
}

/// Every command line the README and the book show parses with the flags
/// `berth` has (a renamed or removed flag, a missing argument, a positional
/// given as a flag fail here), checked by the binary itself without
/// running anything (`BERTH_CHECK_ARGS=1`). Running them is the job of the
/// tests of each chapter.
#[test]
fn every_berth_command_the_book_shows_parses() {
    let (commands, synopses) = book_commands();
    // The tour alone shows about thirty; a parser that found none would
    // check nothing.
    assert!(commands.len() >= 60, "only {} command lines found ({synopses} synopses)", commands.len());
    let mut failed = Vec::new();
    for (at, args) in &commands {
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("exec \"$BERTH_BIN\" {args}"))
            .env("BERTH_BIN", crate::agent::BERTH)
            .env("BERTH_CHECK_ARGS", "1")
            .env("BERTH_TOKEN", "docs-test-token")
            .env_remove("BERTH_SERVER")
            .current_dir(std::env::temp_dir())
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            failed.push(format!("{at}: berth {args}\n    {}", err.lines().next().unwrap_or("")));
        }
    }
    assert!(failed.is_empty(), "{} of {} command lines do not parse:\n{}", failed.len(), commands.len(), failed.join("\n"));
}

/// The README's tour as a new user types it: every line of its `sh`
/// blocks, in order, run by `sh` from a fresh folder outside the
/// repository with only `berth`'s folder added to `PATH`. A line ending in
/// `&` runs in the background (the host, the agent), and the command after
/// it is tried again until it succeeds (the server starting, at most a
/// minute); `export` lines set the variables of the lines after them.
/// Every other command must succeed the first time.
#[test]
fn the_readme_tour_runs_from_another_folder() {
    let _ports = crate::book::DOCS_PORTS.lock().unwrap_or_else(|e| e.into_inner());
    // It builds a policy (a minute of both CPUs): no test measuring a
    // task's rate runs meanwhile (a clean-clone CI run saw a training task
    // at half its rate alone beside it).
    let _cpu = crate::common::cpu_measuring();
    if std::net::TcpListener::bind("127.0.0.1:7450").is_err() || std::net::TcpListener::bind("127.0.0.1:7451").is_err() {
        crate::common::skip("127.0.0.1:7450 or 7451 is taken: the tour's host listens there");
        return;
    }
    let mut lines = Vec::new();
    let mut joined = String::new();
    for line in tour_sh_lines() {
        match line.strip_suffix('\\') {
            Some(part) => joined.push_str(part),
            None => {
                joined.push_str(&line);
                let whole = std::mem::take(&mut joined);
                let code = whole.find(" #").map_or(whole.as_str(), |i| &whole[..i]).trim().to_string();
                if !code.is_empty() {
                    lines.push(code);
                }
            }
        }
    }
    assert!(lines.len() >= 20, "only {} tour lines found", lines.len());
    let dir = std::env::temp_dir().join(format!("berth-tour-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // The tour's own state folder: a fresh host, as on a first try.
    let _ = std::fs::remove_dir_all("/tmp/berth-demo");
    let bin = Path::new(crate::agent::BERTH).parent().unwrap().to_path_buf();
    let path = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()))).unwrap();
    let mut env: Vec<(String, String)> = Vec::new();
    let mut background: Vec<std::process::Child> = Vec::new();
    let mut after_background = false;
    let command = |line: &str, env: &[(String, String)]| {
        let mut c = std::process::Command::new("sh");
        c.arg("-c").arg(line).current_dir(&dir).env("PATH", &path).env_remove("BERTH_TOKEN").env_remove("BERTH_SERVER").env_remove("BERTH_TOKEN_FILE").env("RUST_BACKTRACE", "0");
        c.envs(env.iter().map(|(k, v)| (k, v)));
        c
    };
    let run = |line: &str, env: &[(String, String)]| command(line, env).output().unwrap();
    let mut failure = None;
    for line in &lines {
        if let Some(assign) = line.strip_prefix("export ") {
            let (k, v) = assign.split_once('=').expect("export NAME=VALUE");
            env.push((k.to_string(), v.to_string()));
            continue;
        }
        if let Some(cmd) = line.strip_suffix('&') {
            let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("background.log")).unwrap();
            // exec: the process a stop signals is the command itself.
            let child = command(&format!("exec {}", cmd.trim()), &env).stdin(std::process::Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log).spawn().unwrap();
            background.push(child);
            after_background = true;
            continue;
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(if after_background { 60 } else { 0 });
        let out = loop {
            let out = run(line, &env);
            if out.status.success() || std::time::Instant::now() >= deadline {
                break out;
            }
            std::thread::sleep(std::time::Duration::from_millis(250));
        };
        after_background = false;
        if !out.status.success() {
            failure = Some(format!("{line}\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)));
            break;
        }
    }
    // What the tour left: its jobs on the host (one on the agent's GPUs).
    let listed = failure.is_none().then(|| run("berth jobs --partition p0", &env));
    for mut b in background {
        // SIGTERM: the agent stops its tasks as it leaves.
        // SAFETY: kill(2) on a child this test started.
        unsafe { libc::kill(b.id() as i32, libc::SIGTERM) };
        let _ = b.wait();
    }
    if let Some(f) = failure {
        let log = std::fs::read_to_string(dir.join("background.log")).unwrap_or_default();
        panic!("the tour failed at:\n{f}\n--- the host's and agent's output:\n{}", log.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n"));
    }
    let listed = String::from_utf8_lossy(&listed.unwrap().stdout).into_owned();
    assert!(listed.lines().any(|l| l.contains("running") && l.contains("gpu-a[")), "no tour job runs on the agent's GPUs:\n{listed}");
    assert!(dir.join("report.html").exists() && dir.join("my-policy/my-policy.wasm").exists(), "the tour's report and policy are missing");
    let _ = std::fs::remove_dir_all(&dir);
}
