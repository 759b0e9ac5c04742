//! Readers for Alibaba's GPU cluster trace v2023 ("openb"): node lists and
//! pod lists, in every column variant of the published files. A malformed row
//! is an error naming file, line and column; nothing is silently dropped.

use std::path::{Path, PathBuf};

use berth_core::MILLI_PER_GPU;

/// A row of a trace file that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}:{line}: column {column:?}: {message}", path.display())]
    Row { path: PathBuf, line: u64, column: String, message: String },
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
}

/// One node of a node list (`sn,cpu_milli,memory_mib,gpu,model`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRow {
    pub name: String,
    pub cpu_milli: u32,
    pub memory_mib: u64,
    pub gpus: u32,
    /// GPU model; empty for CPU-only nodes.
    pub model: String,
}

/// One pod of a pod list. Files carry either all eleven columns or only the
/// first five (`multigpu*`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRow {
    pub name: String,
    pub cpu_milli: u32,
    pub memory_mib: u64,
    pub num_gpu: u32,
    pub gpu_milli: u32,
    /// Accepted models (`A|B` alternatives); empty: any.
    pub gpu_spec: Vec<String>,
    pub qos: String,
    pub creation_time: Option<u64>,
    pub deletion_time: Option<u64>,
}

impl PodRow {
    /// Milli-GPU the pod asks for in total.
    pub fn total_gpu_milli(&self) -> u64 {
        u64::from(self.num_gpu) * u64::from(self.gpu_milli)
    }
}

/// A CSV file read row by row, every error naming file, line and column.
pub(crate) struct Reader {
    path: PathBuf,
    inner: csv::Reader<std::fs::File>,
    header: Vec<String>,
}

impl Reader {
    pub(crate) fn open(path: &Path) -> Result<Reader, TraceError> {
        let file = std::fs::File::open(path).map_err(|source| TraceError::Io { path: path.to_path_buf(), source })?;
        let mut inner = csv::ReaderBuilder::new().has_headers(true).trim(csv::Trim::All).from_reader(file);
        let header = inner
            .headers()
            .map_err(|e| TraceError::File { path: path.to_path_buf(), message: e.to_string() })?
            .iter()
            .map(str::to_string)
            .collect();
        Ok(Reader { path: path.to_path_buf(), inner, header })
    }

    pub(crate) fn require(&self, wanted: &[&str]) -> Result<(), TraceError> {
        for (i, w) in wanted.iter().enumerate() {
            if self.header.get(i).map(String::as_str) != Some(*w) {
                return Err(TraceError::File {
                    path: self.path.clone(),
                    message: format!("expected column {} to be {w:?}, header is \"{}\"", i + 1, crate::text::printable(&self.header.join(","), 256)),
                });
            }
        }
        Ok(())
    }

    /// Calls `f` with each record and its line number.
    /// Whether column `index` exists and is named `name` (optional columns).
    pub(crate) fn has_column(&self, index: usize, name: &str) -> bool {
        self.header.get(index).is_some_and(|h| h == name)
    }

    pub(crate) fn rows(&mut self, mut f: impl FnMut(&Row) -> Result<(), TraceError>) -> Result<(), TraceError> {
        let mut record = csv::StringRecord::new();
        loop {
            match self.inner.read_record(&mut record) {
                Ok(false) => return Ok(()),
                Ok(true) => {
                    let line = record.position().map_or(0, |p| p.line());
                    if record.len() != self.header.len() {
                        return Err(TraceError::Row {
                            path: self.path.clone(),
                            line,
                            column: self.header.get(record.len()).map_or_else(|| "(extra)".into(), |h| crate::text::printable(h, 64).into_owned()),
                            message: format!("{} fields, header has {}", record.len(), self.header.len()),
                        });
                    }
                    f(&Row { path: &self.path, header: &self.header, record: &record, line })?;
                }
                Err(e) => {
                    let line = e.position().map_or(0, |p| p.line());
                    return Err(TraceError::Row { path: self.path.clone(), line, column: String::new(), message: e.to_string() });
                }
            }
        }
    }
}

pub(crate) struct Row<'a> {
    path: &'a Path,
    header: &'a [String],
    record: &'a csv::StringRecord,
    line: u64,
}

impl Row<'_> {
    pub(crate) fn err(&self, column: usize, message: impl Into<String>) -> TraceError {
        TraceError::Row {
            path: self.path.to_path_buf(),
            line: self.line,
            column: self.header[column].clone(),
            message: message.into(),
        }
    }
    pub(crate) fn str(&self, column: usize) -> &str {
        &self.record[column]
    }
    pub(crate) fn num<T: std::str::FromStr>(&self, column: usize) -> Result<T, TraceError> {
        let text = self.str(column);
        text.parse().map_err(|_| self.err(column, format!("\"{}\" is not a non-negative integer in range", crate::text::printable(text, 64))))
    }
    fn opt_num(&self, column: usize) -> Result<Option<u64>, TraceError> {
        if self.header.len() <= column || self.str(column).is_empty() { Ok(None) } else { self.num(column).map(Some) }
    }
}

/// Reads a node list.
pub fn read_nodes(path: &Path) -> Result<Vec<NodeRow>, TraceError> {
    let mut reader = Reader::open(path)?;
    reader.require(&["sn", "cpu_milli", "memory_mib", "gpu", "model"])?;
    let mut nodes = Vec::new();
    reader.rows(|row| {
        let node = NodeRow {
            name: row.str(0).to_string(),
            cpu_milli: row.num(1)?,
            memory_mib: row.num(2)?,
            gpus: row.num(3)?,
            model: row.str(4).to_string(),
        };
        if node.name.is_empty() {
            return Err(row.err(0, "empty node name"));
        }
        if node.gpus as usize > berth_core::MAX_GPUS_PER_NODE {
            return Err(row.err(3, format!("{} GPUs exceeds {}", node.gpus, berth_core::MAX_GPUS_PER_NODE)));
        }
        if node.gpus > 0 && node.model.is_empty() {
            return Err(row.err(4, "GPUs without a model"));
        }
        nodes.push(node);
        Ok(())
    })?;
    if nodes.is_empty() {
        return Err(TraceError::File { path: path.to_path_buf(), message: "no nodes".into() });
    }
    Ok(nodes)
}

/// Reads a pod list (eleven-column or five-column variant).
pub fn read_pods(path: &Path) -> Result<Vec<PodRow>, TraceError> {
    let mut reader = Reader::open(path)?;
    reader.require(&["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"])?;
    let full = reader.header.len() > 5;
    if full {
        reader.require(&[
            "name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos", "pod_phase", "creation_time",
            "deletion_time", "scheduled_time",
        ])?;
    }
    let mut pods = Vec::new();
    reader.rows(|row| {
        let pod = PodRow {
            name: row.str(0).to_string(),
            cpu_milli: row.num(1)?,
            memory_mib: row.num(2)?,
            num_gpu: row.num(3)?,
            gpu_milli: row.num(4)?,
            gpu_spec: if full && !row.str(5).is_empty() { row.str(5).split('|').map(str::to_string).collect() } else { Vec::new() },
            qos: if full { row.str(6).to_string() } else { String::new() },
            creation_time: if full { row.opt_num(8)? } else { None },
            deletion_time: if full { row.opt_num(9)? } else { None },
        };
        if pod.name.is_empty() {
            return Err(row.err(0, "empty pod name"));
        }
        if pod.gpu_milli > MILLI_PER_GPU {
            return Err(row.err(4, format!("{} milli-GPU per GPU exceeds 1000", pod.gpu_milli)));
        }
        if pod.num_gpu > 1 && pod.gpu_milli < MILLI_PER_GPU {
            return Err(row.err(4, format!("{} GPUs of {} milli: a shared GPU must be a single GPU", pod.num_gpu, pod.gpu_milli)));
        }
        if pod.num_gpu == 0 && pod.gpu_milli != 0 {
            return Err(row.err(4, format!("{} milli-GPU with 0 GPUs", pod.gpu_milli)));
        }
        if pod.num_gpu > 0 && pod.gpu_milli == 0 {
            return Err(row.err(4, "0 milli-GPU on a GPU pod"));
        }
        if pod.gpu_spec.iter().any(String::is_empty) {
            return Err(row.err(5, format!("empty alternative in {:?}", row.str(5))));
        }
        pods.push(pod);
        Ok(())
    })?;
    if pods.is_empty() {
        return Err(TraceError::File { path: path.to_path_buf(), message: "no pods".into() });
    }
    Ok(pods)
}
