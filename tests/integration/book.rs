//! The book runs verbatim: every command block of docs/src/*.md, run in
//! order by one persistent `bash` per page (the shell a reader most likely
//! types into), from a fresh folder outside the repository.
//!
//! - `sh` blocks: every line is a command (a line that does not yet parse,
//!   like the head of a `for` loop or a `\` continuation, is joined with
//!   the next). Other blocks: the `$ ` lines are commands, the lines under
//!   one are its shown output.
//! - Shown output must still be there, in order, in what the command
//!   printed (with what background processes printed meanwhile): numbers
//!   (except `x.y.z` versions), hex digests and host names are masked and
//!   runs of spaces are one. A shown line `...` skips any lines; a line
//!   ending in `...` matches its start; `  # ...` after a shown line is a
//!   note. A shown first line `Error: ...` (or a `berth ...` line naming an
//!   error) means the command must fail; every other must succeed.
//! - A line ending in `&` runs in the background (its output goes to a log
//!   its shown lines are awaited in; a `berth agent` is awaited until it
//!   registered). The command after it is tried again until it succeeds
//!   (a server starting, at most a minute). Output a background process
//!   prints for a command is awaited for 30 s; a listing whose output does
//!   not match yet (`jobs`, `nodes`, `accounting`, ...) is asked again for
//!   at most 30 s (a job stopping, a heartbeat).
//! - Placeholders and synopses (`<job>`, `[--flag]`, `a|b`, `...` in a
//!   `berth` command) are shown, not run, and counted.
//! - A block whose first command starts a background process begins a new
//!   session: what the page left running is stopped first.
//! - `<!-- docs-test: ... -->` lines above a block (hidden in the book):
//!   `skip: WHY` (not run), `run: LINE` (run before the block: the host a
//!   snippet is documented to talk to), `short: --flag VALUE ...` (a long
//!   run shortened: the block's `berth` commands that have the flag get
//!   this value; where none has it, every one gets the flag).
//!
//! The page's folder has the repository's `examples`, `scripts` and
//! `target` as links, and `../shared` is the workplace's data, so relative
//! paths mean what they mean in the repository. Absolute `/tmp/...` paths a
//! page names (state folders, etcd's data) are removed before it runs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use regex::Regex;

use crate::common::repo_root;

/// The docs' fixed ports (7450, 7451, 7470, 7471, 2479): the README tour and
/// the book's sessions take turns.
pub(crate) static DOCS_PORTS: Mutex<()> = Mutex::new(());

/// One command of a block, where it is, and the output its page shows.
#[derive(Debug)]
struct Step {
    at: String,
    code: String,
    shown: Vec<String>,
}

#[derive(Debug, Default)]
struct Block {
    at: String,
    skip: Option<String>,
    setup: Vec<String>,
    short: Vec<(String, String)>,
    steps: Vec<Step>,
}

/// Whether `code` is a whole shell command (`bash -n` parses it, and it
/// does not end in a continuation).
fn complete(code: &str) -> bool {
    // bash takes a `\` continuation at the end of its input as a whole line.
    if code.trim_end().ends_with('\\') {
        return false;
    }
    Command::new("bash").arg("-n").arg("-c").arg(code).stderr(Stdio::null()).status().unwrap().success()
}

/// The runnable blocks of a page with their directives.
fn blocks(page: &Path) -> Vec<Block> {
    let text = std::fs::read_to_string(page).unwrap();
    let name = page.file_name().unwrap().to_string_lossy().into_owned();
    let directive = Regex::new(r"^<!-- docs-test: (skip|run|short): (.*) -->$").unwrap();
    let (mut out, mut pending) = (Vec::new(), Block::default());
    let mut fence: Option<(String, usize, Vec<&str>)> = None;
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if let Some(lang) = trimmed.strip_prefix("```") {
            match fence.take() {
                None => fence = Some((lang.trim().to_string(), n + 1, Vec::new())),
                Some((lang, first, lines)) => {
                    let mut block = std::mem::take(&mut pending);
                    block.at = format!("{name}:{first}");
                    // A skipped block need not parse (a synopsis).
                    block.steps = if block.skip.is_some() {
                        Vec::new()
                    } else if lang == "sh" {
                        sh_steps(&name, first, &lines)
                    } else {
                        transcript_steps(&name, first, &lines)
                    };
                    if !block.steps.is_empty() || block.skip.is_some() || !block.setup.is_empty() {
                        out.push(block);
                    }
                }
            }
            continue;
        }
        if let Some((_, _, lines)) = &mut fence {
            lines.push(line);
            continue;
        }
        if let Some(d) = directive.captures(trimmed) {
            let value = d[2].trim().to_string();
            match &d[1] {
                "skip" => pending.skip = Some(value),
                "run" => pending.setup.push(value),
                _ => {
                    let words: Vec<&str> = value.split_whitespace().collect();
                    assert!(words.len() % 2 == 0, "{name}:{}: short: takes --flag VALUE pairs", n + 1);
                    pending.short.extend(words.chunks(2).map(|w| (w[0].to_string(), w[1].to_string())));
                }
            }
        } else if trimmed.starts_with("<!-- docs-test") {
            panic!("{name}:{}: unknown directive {trimmed}", n + 1);
        }
    }
    out
}

fn sh_steps(name: &str, first: usize, lines: &[&str]) -> Vec<Step> {
    let (mut steps, mut code, mut at) = (Vec::new(), String::new(), 0);
    for (i, line) in lines.iter().enumerate() {
        if code.is_empty() {
            if line.trim().is_empty() || line.trim_start().starts_with('#') {
                continue;
            }
            at = first + 1 + i;
        }
        code.push_str(line);
        code.push('\n');
        // A placeholder (`<job>`) need not parse: it is not run.
        if complete(&code) || (!code.trim_end().ends_with('\\') && placeholder(&code).is_some()) {
            steps.push(Step { at: format!("{name}:{at}"), code: std::mem::take(&mut code).trim().to_string(), shown: Vec::new() });
        }
    }
    assert!(code.is_empty(), "{name}:{at}: a command that never parses:\n{code}");
    steps
}

fn transcript_steps(name: &str, first: usize, lines: &[&str]) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    let mut open = false;
    for (i, line) in lines.iter().enumerate() {
        if let Some(cmd) = line.strip_prefix("$ ") {
            steps.push(Step { at: format!("{name}:{}", first + 1 + i), code: format!("{cmd}\n"), shown: Vec::new() });
            open = !complete(&steps.last().unwrap().code);
        } else if let Some(step) = steps.last_mut() {
            if open {
                step.code.push_str(line);
                step.code.push('\n');
                open = !complete(&step.code);
            } else {
                step.shown.push(line.to_string());
            }
        }
    }
    for s in &mut steps {
        s.code = s.code.trim().to_string();
        while s.shown.last().is_some_and(|l| l.trim().is_empty()) {
            s.shown.pop();
        }
    }
    steps
}

/// `code` with quoted text and comments taken out: what placeholders are
/// looked for in.
fn unquoted(code: &str) -> String {
    let (mut out, mut quote, mut comment) = (String::new(), None::<char>, false);
    let mut prev = ' ';
    for c in code.chars() {
        if comment {
            if c == '\n' {
                comment = false;
                out.push(c);
            }
        } else {
            match (quote, c) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '\'' | '"') => quote = Some(c),
                (None, '#') if prev.is_whitespace() => comment = true,
                (None, c) => out.push(c),
            }
        }
        prev = c;
    }
    out
}

/// Where the comment of the last line of `code` starts (a `#` after a
/// space, outside quotes).
fn comment_start(code: &str) -> Option<usize> {
    let (mut quote, mut prev, mut at) = (None::<char>, ' ', None);
    for (i, c) in code.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (None, '\'' | '"') => quote = Some(c),
            (None, '#') if prev.is_whitespace() && at.is_none() => at = Some(i),
            (None, '\n') => at = None,
            _ => {}
        }
        prev = c;
    }
    at
}

/// Why `code` is shown but not run, if it is a placeholder or a synopsis.
fn placeholder(code: &str) -> Option<&'static str> {
    let bare = unquoted(&code.replace("\\\n", " "));
    if Regex::new(r"<[A-Za-z]").unwrap().is_match(&bare) {
        return Some("placeholder <...>");
    }
    let berth = Regex::new(r"(^|[;&|(\n]\s*)(berth|\./target/release/berth) [^;&|\n]*").unwrap();
    for m in berth.find_iter(&bare) {
        let args = m.as_str();
        if args.contains(['[', ']']) || args.contains("...") {
            return Some("synopsis [...]");
        }
    }
    if Regex::new(r"(^|\s)berth [^;&\n]*\w\|\w").unwrap().is_match(&bare) {
        return Some("synopsis a|b");
    }
    None
}

/// A line as the comparison sees it: numbers (not versions), digests and
/// host names masked, spaces collapsed.
fn normalise(line: &str) -> String {
    // Versions (x.y.z) stay as they are: their digits become letters before
    // the other numbers are masked.
    let version = Regex::new(r"\b\d+\.\d+\.\d+\b").unwrap();
    let mut s = version
        .replace_all(line.trim(), |c: &regex::Captures| {
            let lettered: String = c[0].chars().map(|ch| ch.to_digit(10).map_or(ch, |d| char::from(b'a' + d as u8))).collect();
            format!("V({lettered})")
        })
        .into_owned();
    for (re, by) in [(r"\b[0-9a-f]{8,}\b", "H"), (r"0x[0-9a-fA-F]+", "H"), (r"\d+(\.\d+)?", "N"), (r"[\w.-]+:N@", "HOST:N@"), (r"\s+", " ")] {
        s = Regex::new(re).unwrap().replace_all(&s, by).into_owned();
    }
    s
}

/// Whether every shown line is in `actual`, in order, or else anywhere in
/// `aside` (what background processes printed meanwhile: its order against
/// the command's own output is the scheduler's).
fn matches(shown: &[String], actual: &str, aside: &str) -> Result<(), String> {
    let annotation = Regex::new(r"\s{2,}# .*$").unwrap();
    let actual: Vec<String> = actual.lines().map(normalise).collect();
    let aside: Vec<String> = aside.lines().map(normalise).collect();
    let is = |want: &str, line: &str| match want.strip_suffix("...") {
        Some(prefix) => line.starts_with(prefix.trim_end()),
        None => line == want,
    };
    let mut at = 0;
    for line in shown {
        let want = normalise(&annotation.replace(line, ""));
        if want.is_empty() || want == "..." {
            continue;
        }
        if let Some(i) = actual[at..].iter().position(|a| is(&want, a)) {
            at += i + 1;
        } else if !aside.iter().any(|a| is(&want, a)) {
            return Err(line.clone());
        }
    }
    Ok(())
}

/// Commands that only read: tried again while their output does not match.
fn is_listing(code: &str) -> bool {
    Regex::new(r"^(BERTH_\w+=\S+ )?berth (jobs|nodes|accounting|explain|decisions|partitions|alloc list|policy report|policy history|credits|quote|compactions)\b")
        .unwrap()
        .is_match(code)
}

fn expects_failure(shown: &[String]) -> bool {
    shown.first().is_some_and(|l| l.starts_with("Error:") || (l.starts_with("berth ") && l.contains("error")))
}

/// One page's shell: commands go in on stdin, each one's output and exit
/// status come back as files.
struct Shell {
    child: Child,
    work: PathBuf,
    next: usize,
    background_log: PathBuf,
}

impl Shell {
    fn start(dir: &Path, work: &Path, path: &std::ffi::OsStr) -> Shell {
        use std::os::unix::process::CommandExt;
        std::fs::create_dir_all(work).unwrap();
        let background_log = work.join("background.log");
        std::fs::write(&background_log, "").unwrap();
        let mut c = Command::new("bash");
        c.arg("--noprofile").arg("--norc").current_dir(dir)
            .env("PATH", path)
            .env("RUST_BACKTRACE", "0")
            .env_remove("BERTH_TOKEN")
            .env_remove("BERTH_SERVER")
            .env_remove("BERTH_TOKEN_FILE")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: setsid(2) between fork and exec: the shell and all it
        // starts form one process group the page's end stops.
        unsafe {
            c.pre_exec(|| {
                libc::setsid();
                Ok(())
            })
        };
        Shell { child: c.spawn().unwrap(), work: work.to_path_buf(), next: 0, background_log }
    }

    fn send(&mut self, text: &str) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(text.as_bytes()).unwrap();
        stdin.flush().unwrap();
    }

    fn background_len(&self) -> usize {
        std::fs::metadata(&self.background_log).map(|m| m.len() as usize).unwrap_or(0)
    }

    fn background_since(&self, from: usize) -> String {
        let all = std::fs::read(&self.background_log).unwrap_or_default();
        String::from_utf8_lossy(&all[from.min(all.len())..]).into_owned()
    }

    /// Runs `code` in the page's shell; (exit status, output).
    fn run(&mut self, code: &str, limit: Duration) -> Result<(i32, String), String> {
        let n = self.next;
        self.next += 1;
        let (out, rc) = (self.work.join(format!("out.{n}")), self.work.join(format!("rc.{n}")));
        self.send(&format!(
            "{{ {code}\n}} > '{}' 2>&1 < /dev/null; echo $? > '{}.tmp'; mv '{}.tmp' '{}'\n",
            out.display(),
            rc.display(),
            rc.display(),
            rc.display()
        ));
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(status) = std::fs::read_to_string(&rc) {
                let output = std::fs::read_to_string(&out).unwrap_or_default();
                return Ok((status.trim().parse().unwrap_or(-1), output));
            }
            if Instant::now() > deadline {
                return Err(format!("still running after {} s", limit.as_secs()));
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("the page's shell ended ({status})"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn background(&mut self, code: &str) {
        let log = self.background_log.display().to_string();
        self.send(&format!("{{ {code}\n}} >> '{log}' 2>&1 < /dev/null &\n"));
    }

    /// Stops everything the page started in the background: SIGTERM to
    /// each process of its group but the shell (agents stop their tasks,
    /// which have groups of their own, as they leave), SIGKILL after 15 s.
    fn stop_all(&mut self) {
        for signal in [libc::SIGTERM, libc::SIGKILL] {
            let deadline = Instant::now() + Duration::from_secs(15);
            for pid in self.group_members() {
                if pid != self.child.id() as i32 {
                    // SAFETY: kill(2) on a process of the group this test created.
                    unsafe { libc::kill(pid, signal) };
                }
            }
            while Instant::now() < deadline && self.group_members().len() > 1 {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        // The shell reaps what ended.
        self.send("wait\n");
    }

    /// The live processes of the page's process group (the shell included).
    fn group_members(&self) -> Vec<i32> {
        let group = self.child.id() as i32;
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                // stat: "pid (comm) state ppid pgrp ..."; zombies are gone.
                std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().and_then(|s| {
                    let rest: Vec<String> = s.rsplit_once(") ")?.1.split(' ').take(3).map(str::to_string).collect();
                    Some(rest[0] != "Z" && rest[2].parse::<i32>().ok() == Some(group))
                }) == Some(true)
            })
            .collect()
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        let group = self.child.id() as i32;
        // SAFETY: kill(2) on the process group this test created.
        unsafe { libc::kill(-group, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline && !self.group_members().is_empty() {
            std::thread::sleep(Duration::from_millis(100));
        }
        // SAFETY: as above.
        unsafe { libc::kill(-group, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

#[derive(Default)]
struct Tally {
    run: usize,
    outputs: usize,
    placeholders: Vec<String>,
    skipped: Vec<String>,
}

/// Runs one page; the first command that fails or whose output differs
/// from the page's is the error.
fn run_page(page: &Path, root: &Path, tally: &mut Tally) -> Result<(), String> {
    let name = page.file_stem().unwrap().to_string_lossy().into_owned();
    let blocks = blocks(page);
    if blocks.iter().all(|b| b.skip.is_some()) {
        tally.skipped.extend(blocks.iter().map(|b| format!("{}: {}", b.at, b.skip.as_deref().unwrap())));
        return Ok(());
    }
    let text = std::fs::read_to_string(page).unwrap();
    if text.contains("scripts/etcd.sh") && Command::new("etcd").arg("--version").stdout(Stdio::null()).status().is_err() {
        crate::common::skip(&format!("{name}: etcd is not installed (scripts/install-etcd.sh)"));
        return Ok(());
    }
    // The page's scratch paths start empty, as on a first try.
    for scratch in Regex::new(r"/tmp/[\w.-]+(/[\w.-]+)*").unwrap().find_iter(&text) {
        let p = Path::new(scratch.as_str());
        let _ = std::fs::remove_dir_all(p).or_else(|_| std::fs::remove_file(p));
    }
    let dir = root.join(&name);
    std::fs::create_dir_all(&dir).unwrap();
    let target = Path::new(crate::agent::BERTH).parent().unwrap().parent().unwrap();
    for (link, to) in [("examples", repo_root().join("examples")), ("scripts", repo_root().join("scripts")), ("target", target.to_path_buf())] {
        std::os::unix::fs::symlink(to, dir.join(link)).unwrap();
    }
    let bin = Path::new(crate::agent::BERTH).parent().unwrap().to_path_buf();
    let path = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()))).unwrap();
    let mut shell = Shell::start(&dir, &root.join(format!(".{name}")), &path);
    let (mut started_background, mut after_background) = (false, false);
    for block in &blocks {
        if let Some(why) = &block.skip {
            tally.skipped.push(format!("{}: {why}", block.at));
            continue;
        }
        let mut steps: Vec<Step> = block.setup.iter().map(|s| Step { at: format!("{} (run:)", block.at), code: s.clone(), shown: Vec::new() }).collect();
        for s in &block.steps {
            let mut code = s.code.clone();
            steps.push(Step { at: s.at.clone(), code: std::mem::take(&mut code), shown: s.shown.clone() });
        }
        for (flag, value) in &block.short {
            let re = Regex::new(&format!(r"{}(\s+|=)\S+", regex::escape(flag))).unwrap();
            let set = format!("{flag} {value}");
            let present = steps.iter().any(|s| re.is_match(&s.code));
            let mut used = false;
            for s in steps.iter_mut().filter(|s| s.code.starts_with("berth ") || s.code.starts_with("./target/release/berth ")) {
                if re.is_match(&s.code) {
                    s.code = re.replace_all(&s.code, set.as_str()).into_owned();
                    used = true;
                } else if !present {
                    // Before a trailing comment, not in it.
                    let end = comment_start(&s.code).unwrap_or(s.code.len());
                    s.code = format!("{} {set} {}", s.code[..end].trim_end(), &s.code[end..]).trim_end().to_string();
                    used = true;
                }
            }
            if !used {
                return Err(format!("{}: short: {flag}: the block has no berth command", block.at));
            }
        }
        let starts_session = steps.iter().find(|s| placeholder(&s.code).is_none()).is_some_and(|s| is_background(&s.code));
        if starts_session && started_background {
            let t = Instant::now();
            shell.stop_all();
            if t.elapsed() > Duration::from_secs(5) {
                eprintln!("book: {}: stopping the previous session took {:.1} s", block.at, t.elapsed().as_secs_f64());
            }
        }
        for step in &steps {
            if let Some(why) = placeholder(&step.code) {
                tally.placeholders.push(format!("{}: {why}: {}", step.at, step.code.lines().next().unwrap_or("")));
                continue;
            }
            if step.code.contains("../shared/") && !root.join("shared").exists() {
                // What follows in the block reads what this would write.
                crate::common::skip(&format!("{}: the workplace's traces (../shared) are not here (the rest of the block too)", step.at));
                break;
            }
            tally.run += 1;
            if is_background(&step.code) {
                let from = shell.background_len();
                shell.background(step.code.trim_end().trim_end_matches('&'));
                started_background = true;
                after_background = true;
                let agent = Regex::new(r"^berth agent .*--node (\S+)").unwrap();
                let mut awaited = step.shown.clone();
                if awaited.is_empty() {
                    if let Some(node) = agent.captures(&step.code) {
                        awaited.push(format!("berth agent: node {} registered ...", &node[1]));
                    }
                }
                if !awaited.is_empty() {
                    let deadline = Instant::now() + Duration::from_secs(60);
                    loop {
                        let log = shell.background_since(from);
                        match matches(&awaited, &log, "") {
                            Ok(()) => break,
                            Err(line) if Instant::now() > deadline => {
                                return Err(format!("{}: {}\n  never printed: {line}\n  printed:\n{log}", step.at, step.code));
                            }
                            Err(_) => std::thread::sleep(Duration::from_millis(100)),
                        }
                    }
                    tally.outputs += step.shown.len().min(1);
                }
                continue;
            }
            let fail_expected = expects_failure(&step.shown);
            let listing = is_listing(&step.code);
            let start = Instant::now();
            let from = shell.background_len();
            loop {
                let (status, output) = shell.run(&step.code, Duration::from_secs(600)).map_err(|e| format!("{}: {}\n  {e}", step.at, step.code))?;
                if (status == 0) == fail_expected {
                    if after_background && start.elapsed() < Duration::from_secs(60) {
                        std::thread::sleep(Duration::from_millis(250));
                        continue;
                    }
                    let want = if fail_expected { "to fail" } else { "to succeed" };
                    return Err(format!("{}: {}\n  expected {want}, exit status {status}:\n{output}", step.at, step.code));
                }
                // What background processes print for it may come later; a
                // listing is asked again instead.
                let settle = Instant::now() + Duration::from_millis(if listing { 500 } else { 30_000 });
                let mismatch = loop {
                    let aside = shell.background_since(from);
                    match matches(&step.shown, &output, &aside) {
                        Ok(()) => break None,
                        Err(line) if Instant::now() > settle => break Some((line, format!("{output}--- and in the background:\n{aside}"))),
                        Err(_) => std::thread::sleep(Duration::from_millis(200)),
                    }
                };
                match mismatch {
                    None => break,
                    Some(_) if listing && start.elapsed() < Duration::from_secs(30) => continue,
                    Some((line, seen)) => {
                        return Err(format!("{}: {}\n  the page shows a line it did not print:\n    {line}\n  it printed:\n{seen}", step.at, step.code));
                    }
                }
            }
            if !step.shown.is_empty() {
                tally.outputs += 1;
            }
            if start.elapsed() > Duration::from_secs(5) {
                eprintln!("book: {}: {:.1} s", step.at, start.elapsed().as_secs_f64());
            }
            // A variable set is not the server answering yet.
            after_background &= step.code.starts_with("export ");
        }
    }
    Ok(())
}

fn is_background(code: &str) -> bool {
    let code = code.trim_end();
    code.ends_with('&') && !code.ends_with("&&")
}

/// Every command block of the book runs as written, and the output a page
/// shows is what the command prints (see the module's comment for the
/// rules). README.md's tour is run by
/// `docs::the_readme_tour_runs_from_another_folder`.
#[test]
fn every_command_block_of_the_book_runs_as_shown() {
    let _ports = DOCS_PORTS.lock().unwrap_or_else(|e| e.into_inner());
    // Its sessions load the CPUs on purpose (a chapter's CPU hogs, a policy
    // build): no test measuring a task's rate runs meanwhile.
    let _cpu = crate::common::cpu_measuring();
    for port in [7450, 7451, 7470, 7471, 2479, 2480] {
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
            crate::common::skip(&format!("127.0.0.1:{port} is taken: the book's hosts listen there"));
            return;
        }
    }
    let root = std::env::temp_dir().join(format!("berth-book-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    // The traces: beside the repository, or where $BERTH_OPENB_DIR says.
    let shared = std::env::var_os("BERTH_OPENB_DIR").map(|d| PathBuf::from(d).join("../..")).unwrap_or_else(|| repo_root().join("../shared"));
    if let Ok(shared) = shared.canonicalize() {
        std::os::unix::fs::symlink(shared, root.join("shared")).unwrap();
    }
    let only = std::env::var("BERTH_BOOK_PAGE").ok();
    let mut tally = Tally::default();
    let mut failures = Vec::new();
    for page in crate::docs::book_pages() {
        let stem = page.file_stem().unwrap().to_string_lossy().into_owned();
        if only.as_ref().is_some_and(|o| *o != stem) {
            continue;
        }
        let started = Instant::now();
        let result = run_page(&page, &root, &mut tally);
        eprintln!("book: {stem}: {} in {:.1} s", if result.is_ok() { "ok" } else { "FAILED" }, started.elapsed().as_secs_f64());
        if let Err(e) = result {
            failures.push(format!("{stem}.md: {e}"));
        }
    }
    eprintln!("book: {} commands run, {} outputs compared", tally.run, tally.outputs);
    for p in &tally.placeholders {
        eprintln!("book: not run, {p}");
    }
    for s in &tally.skipped {
        eprintln!("book: skipped block {s}");
    }
    assert!(failures.is_empty(), "{} page(s) do not run as written:\n{}", failures.len(), failures.join("\n\n"));
    if only.is_none() {
        assert!(tally.run >= 100 && tally.outputs >= 40, "only {} commands run, {} outputs compared", tally.run, tally.outputs);
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn the_runner_reads_blocks_as_documented() {
    // Masks: numbers and digests, not versions or words.
    assert_eq!(normalise("  job 12   on gpu-a[0, 1]  v2 spread@1.0.0 (03bf09583281)"), "job N on gpu-a[N, N] vN spread@V(b.a.a) (H)");
    assert!(matches(&["job 1".into(), "...".into(), "  gpu-a ...".into()], "job 7\nx\ngpu-a ready\n", "").is_ok());
    assert_eq!(matches(&["job 1 running".into(), "job 2 pending".into()], "job 2 pending\njob 1 running\n", ""), Err("job 2 pending".into()));
    // What a background process printed counts in any order.
    assert!(matches(&["job 1 running".into(), "GPU-0".into()], "job 1 running\n", "GPU-0\n").is_ok());
    assert!(matches(&["berth serve: API on http://127.0.0.1:7471          # the standby".into()], "", "berth serve: API on http://127.0.0.1:7471\n").is_ok());
    assert_eq!(placeholder("kill -9 <gpu-b's agent>; sleep 4"), Some("placeholder <...>"));
    assert_eq!(placeholder("berth replay --fleet asi [--days 7]"), Some("synopsis [...]"));
    assert_eq!(placeholder("berth policy new --lang rust|python my-policy"), Some("synopsis a|b"));
    assert_eq!(placeholder("curl -s x | grep -E \"^berth_(a|b)\""), None);
    assert_eq!(placeholder("berth submit --gpus 1 -- sh -c '[ $i = 4 ] && berth checkpointed'"), None);
    assert_eq!(placeholder("echo off > /tmp/power-b"), None);
    let steps = transcript_steps("p", 1, &["$ berth submit --gpus 1 -- \\", "    sh -c 'sleep 1'", "job 1", "$ berth jobs", "   job part", ""]);
    assert_eq!(steps.len(), 2);
    assert!(steps[0].code.contains("sh -c 'sleep 1'") && steps[0].shown == ["job 1"]);
    let steps = sh_steps("p", 1, &["for i in 1 2; do", "  echo $i", "done", "# a comment", "berth jobs   # list"]);
    assert_eq!(steps.len(), 2);
    assert!(expects_failure(&["Error: PermissionDenied: ...".into()]) && !expects_failure(&["job 1".into()]));
    assert_eq!(comment_start("berth x --a '#1'   # note"), Some(19));
    assert_eq!(comment_start("berth x --a 1"), None);
}
