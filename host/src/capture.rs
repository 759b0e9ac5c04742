//! The capture of each partition's engine inputs (see [`berth_core::capture`]),
//! written as JSON lines in `capture/<partition>/` of the state directory.
//!
//! Each host start begins a segment: its first file opens with the engine's
//! settings and the whole fleet, and every input follows in the order the
//! engine was given it. Files are cut past a size and the oldest deleted
//! past the partition's bound, so an exact re-decision needs a segment
//! whose first file is still there; a counterfactual reads any part.
//!
//! One line is one input: a readable, greppable, appendable format; a
//! partition's inputs are small (a pass's decisions, the nodes it changed),
//! so a columnar file would save little for what it costs to append to.
//! Job commands and environments never reach the engine, so they are never
//! captured.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use berth_core::capture::{Input, FORMAT, VERSION};
use serde::{Deserialize, Serialize};

/// The first line of every file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub format: String,
    pub version: u32,
    pub partition: String,
    /// The segment (one per host start) and this file's place in it.
    pub segment: u64,
    pub part: u64,
    pub started_unix_ms: u64,
    /// Set by an export that kept only inputs from a time on (`since`,
    /// `until`): such a segment misses inputs before its window, so it
    /// serves a counterfactual, not an exact re-decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<(Option<u64>, Option<u64>)>,
}

/// One captured line after the header: an input and the wall clock when it
/// was written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Line {
    pub unix_ms: u64,
    #[serde(flatten)]
    pub input: Input,
}

/// How much capture a partition keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Every file of the partition together; past it the oldest are deleted.
    pub total_bytes: u64,
    /// A file is cut past this many bytes.
    pub file_bytes: u64,
}

impl Bounds {
    pub fn of_total(total_bytes: u64) -> Bounds {
        Bounds { total_bytes, file_bytes: (total_bytes / 8).clamp(1 << 16, 64 << 20) }
    }
}

/// A partition's capture files being written.
pub struct CaptureLog {
    dir: PathBuf,
    partition: String,
    bounds: Bounds,
    segment: u64,
    part: u64,
    out: std::io::BufWriter<std::fs::File>,
    bytes: u64,
    started_unix_ms: u64,
    /// Writing failed once: capture stops (logged) rather than fail the host.
    broken: bool,
    /// When the buffer last went to the file: at most a second's inputs
    /// wait in memory (a write per lock of the partition cost the host 5%
    /// of its decisions); an export or a stop writes them first.
    flushed: std::time::Instant,
}

/// File name of a segment's part: sorted by name is sorted by time.
fn file_name(segment: u64, part: u64) -> String {
    format!("{segment:010}-{part:06}.jsonl")
}

/// The partition's capture files, oldest first, with their segment and part.
pub fn files(dir: &Path) -> std::io::Result<Vec<(u64, u64, PathBuf)>> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let path = entry?.path();
        let Some(stem) = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".jsonl")) else { continue };
        let Some((s, p)) = stem.split_once('-') else { continue };
        if let (Ok(s), Ok(p)) = (s.parse(), p.parse()) {
            out.push((s, p, path));
        }
    }
    out.sort();
    Ok(out)
}

impl CaptureLog {
    /// Opens a new segment in `dir` (after the ones there).
    pub fn open(dir: &Path, partition: &str, bounds: Bounds, unix_ms: u64) -> std::io::Result<CaptureLog> {
        std::fs::create_dir_all(dir)?;
        let segment = files(dir)?.last().map_or(1, |(s, _, _)| s + 1);
        let (out, bytes) = Self::create(dir, partition, segment, 0, unix_ms)?;
        let log = CaptureLog { dir: dir.to_path_buf(), partition: partition.to_string(), bounds, segment, part: 0, out, bytes, started_unix_ms: unix_ms, broken: false, flushed: std::time::Instant::now() };
        // A host restarting often writes a start each time: the bound holds
        // across starts too.
        log.prune()?;
        Ok(log)
    }

    fn create(dir: &Path, partition: &str, segment: u64, part: u64, unix_ms: u64) -> std::io::Result<(std::io::BufWriter<std::fs::File>, u64)> {
        let path = dir.join(file_name(segment, part));
        let mut out = std::io::BufWriter::with_capacity(256 << 10, std::fs::OpenOptions::new().create_new(true).write(true).open(&path)?);
        let header = Header { format: FORMAT.into(), version: VERSION, partition: partition.into(), segment, part, started_unix_ms: unix_ms, window: None };
        let line = serde_json::to_string(&header).map_err(std::io::Error::other)?;
        writeln!(out, "{line}")?;
        Ok((out, line.len() as u64 + 1))
    }

    /// Appends `inputs`, cutting and pruning files past the bounds.
    pub fn write(&mut self, inputs: Vec<Input>, unix_ms: u64) {
        if self.broken {
            return;
        }
        if let Err(e) = self.try_write(inputs, unix_ms) {
            self.fail(e);
        }
    }

    /// Sends what is buffered to the file (before an export, at a stop).
    pub fn sync(&mut self) {
        if !self.broken
            && let Err(e) = self.out.flush()
        {
            self.fail(e);
        }
        self.flushed = std::time::Instant::now();
    }

    fn fail(&mut self, e: std::io::Error) {
        tracing::error!(target: "berth::serve", partition = %self.partition, dir = %self.dir.display(), error = %e, "capture stopped: writing failed");
        self.broken = true;
    }

    fn try_write(&mut self, inputs: Vec<Input>, unix_ms: u64) -> std::io::Result<()> {
        for input in inputs {
            let line = serde_json::to_string(&Line { unix_ms, input }).map_err(std::io::Error::other)?;
            writeln!(self.out, "{line}")?;
            self.bytes += line.len() as u64 + 1;
        }
        if self.flushed.elapsed() >= std::time::Duration::from_secs(1) {
            self.out.flush()?;
            self.flushed = std::time::Instant::now();
        }
        if self.bytes > self.bounds.file_bytes {
            self.out.flush()?;
            self.part += 1;
            let (out, bytes) = Self::create(&self.dir, &self.partition, self.segment, self.part, unix_ms)?;
            self.out = out;
            self.bytes = bytes;
            self.prune()?;
        }
        Ok(())
    }

    /// Deletes the oldest files (never the one being written) while the
    /// partition's files together exceed the bound.
    fn prune(&self) -> std::io::Result<()> {
        let files = files(&self.dir)?;
        let mut total: u64 = files.iter().map(|(_, _, p)| std::fs::metadata(p).map_or(0, |m| m.len())).sum();
        for (s, p, path) in files {
            if total <= self.bounds.total_bytes || (s, p) == (self.segment, self.part) {
                break;
            }
            total = total.saturating_sub(std::fs::metadata(&path).map_or(0, |m| m.len()));
            std::fs::remove_file(&path)?;
        }
        Ok(())
    }

    pub fn started_unix_ms(&self) -> u64 {
        self.started_unix_ms
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The bytes of a partition's capture files: segment starts (the whole
/// fleet each) and everything else.
pub fn sizes(dir: &Path) -> std::io::Result<(u64, u64)> {
    let (mut starts, mut rest) = (0, 0);
    for (_, _, path) in files(dir)? {
        for line in std::io::BufReader::new(std::fs::File::open(&path)?).lines() {
            let line = line?;
            let bytes = line.len() as u64 + 1;
            if line.contains("\"input\":\"start\"") {
                starts += bytes;
            } else {
                rest += bytes;
            }
        }
    }
    Ok((starts, rest))
}

/// Where partition `name`'s capture lives under the state directory.
pub fn dir_of(state_dir: &Path, name: &str) -> PathBuf {
    state_dir.join("capture").join(name)
}

/// What an export selects: engine seconds (the host clock's), inclusive.
#[derive(Clone, Copy, Debug, Default)]
pub struct Window {
    pub since: Option<u64>,
    pub until: Option<u64>,
}

/// The partition's captured lines in order, headers included, within
/// `window`. An input without a time of its own (a registration, a
/// forget) goes with the next one that has one (a registration comes just
/// before its arrival); headers and each segment's start always come, so
/// the output stays readable, and with `since` the headers say so. `each`
/// gets every line's text.
pub fn export(dir: &Path, window: Window, mut each: impl FnMut(&str) -> std::io::Result<()>) -> std::io::Result<u64> {
    let mut lines = 0;
    let inside = |t: u64| window.since.is_none_or(|s| t >= s) && window.until.is_none_or(|u| t <= u);
    let mut waiting: Vec<String> = Vec::new();
    let mut now: Option<u64> = None;
    for (_, _, path) in files(dir)? {
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue, // pruned meanwhile
            Err(e) => return Err(e),
        };
        for line in std::io::BufReader::new(file).lines() {
            let line = line?;
            // A torn last line (a crash mid-write) is left out.
            let Ok(value) = serde_json::from_str::<serde_json::Value>(&line) else { continue };
            if value.get("format").is_some() {
                let text = match (serde_json::from_value::<Header>(value), window.since.is_some() || window.until.is_some()) {
                    (Ok(mut h), true) => {
                        h.window = Some((window.since, window.until));
                        serde_json::to_string(&h).map_err(std::io::Error::other)?
                    }
                    _ => line,
                };
                each(&text)?;
                lines += 1;
                continue;
            }
            if value.get("input").and_then(|i| i.as_str()) == Some("start") {
                each(&line)?;
                lines += 1;
                continue;
            }
            match value.get("now").and_then(|n| n.as_u64()) {
                None => waiting.push(line),
                Some(t) => {
                    now = Some(t);
                    let keep = inside(t);
                    for w in waiting.drain(..) {
                        if keep {
                            each(&w)?;
                            lines += 1;
                        }
                    }
                    if keep {
                        each(&line)?;
                        lines += 1;
                    }
                }
            }
        }
    }
    // Inputs after the last timed one go with it.
    if now.is_none_or(inside) {
        for w in waiting {
            each(&w)?;
            lines += 1;
        }
    }
    Ok(lines)
}

/// A capture read back: each segment's lines in order (a segment opens
/// with its start when its first file was kept).
#[derive(Debug, Default)]
pub struct Capture {
    pub partition: String,
    pub segments: Vec<Segment>,
}

#[derive(Debug, Default)]
pub struct Segment {
    pub id: u64,
    /// Exported from a time on: inputs before it are missing.
    pub windowed: bool,
    pub inputs: Vec<Line>,
    /// Lines that were not inputs of this version (told, not fatal).
    pub skipped: u64,
}

impl Segment {
    /// Whether the segment begins with the engine's start (exact
    /// re-decision needs it).
    pub fn complete(&self) -> bool {
        !self.windowed && matches!(self.inputs.first(), Some(Line { input: Input::Start { .. }, .. }))
    }
}

/// The most bytes of one captured line read back.
pub const MAX_LINE_BYTES: usize = 256 << 20;

/// Reads an exported capture (or a partition's files joined).
pub fn read(mut reader: impl std::io::BufRead, origin: &str) -> anyhow::Result<Capture> {
    use std::io::Read;
    let mut capture = Capture::default();
    let mut buf = Vec::new();
    for n in 0.. {
        buf.clear();
        // Bounded before it is held: a line without an end cannot fill memory.
        let got = (&mut reader).take(MAX_LINE_BYTES as u64 + 1).read_until(b'\n', &mut buf).map_err(|e| anyhow::anyhow!("{origin}: line {}: {e}", n + 1))?;
        if got == 0 {
            break;
        }
        anyhow::ensure!(buf.len() <= MAX_LINE_BYTES, "{origin}: line {} is longer than {MAX_LINE_BYTES} bytes", n + 1);
        let line = std::str::from_utf8(&buf).map_err(|_| anyhow::anyhow!("{origin}: line {} is not UTF-8", n + 1))?.trim_end_matches(['\n', '\r']);
        if line.trim().is_empty() {
            continue;
        }
        if line.contains("\"format\"")
            && let Ok(h) = serde_json::from_str::<Header>(line)
        {
            anyhow::ensure!(h.format == FORMAT, "{origin}: line {}: format {:?}, not {FORMAT}", n + 1, crate::text::printable(&h.format, 64));
            anyhow::ensure!(h.version == VERSION, "{origin}: line {}: {FORMAT} version {}; this berth reads version {VERSION}", n + 1, h.version);
            if capture.partition.is_empty() {
                capture.partition = h.partition.clone();
            }
            if capture.segments.last().is_none_or(|s| s.id != h.segment) {
                capture.segments.push(Segment { id: h.segment, ..Default::default() });
            }
            if h.window.is_some_and(|(since, _)| since.is_some()) {
                capture.segments.last_mut().expect("just pushed").windowed = true;
            }
            continue;
        }
        let Some(segment) = capture.segments.last_mut() else { anyhow::bail!("{origin}: line {}: an input before any header", n + 1) };
        match serde_json::from_str::<Line>(line) {
            Ok(l) => segment.inputs.push(l),
            Err(_) => segment.skipped += 1,
        }
    }
    Ok(capture)
}
