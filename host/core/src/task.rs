//! The resource shape of one task: what the predicate checks and what an
//! allocation holds.

use berth_sdk::Task;

use crate::units::ModelId;
use crate::units::MILLI_PER_GPU;

/// What one task (a job, or one task of a gang) asks of a single node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TaskShape {
    /// GPUs wanted on the node; 0 for CPU-only tasks.
    pub gpu_count: u32,
    /// Thousandths wanted on each of those GPUs (1..=1000; < 1000 = shared).
    pub gpu_milli: u32,
    /// CPU in thousandths of a core.
    pub cpu_milli: u32,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Accepted GPU models; empty accepts any.
    pub models: Vec<ModelId>,
}

impl TaskShape {
    /// Total milli-GPU the task holds once placed.
    pub fn total_gpu_milli(&self) -> u64 {
        u64::from(self.gpu_count) * u64::from(self.gpu_milli)
    }

    /// Whether the shape is well formed: a shared GPU is a single GPU, GPU
    /// shares lie in 1..=1000, and a CPU-only task asks no GPU share.
    pub fn check(&self) -> Result<(), String> {
        if self.gpu_count == 0 && self.gpu_milli != 0 {
            return Err(format!("gpu_milli {} with 0 GPUs", self.gpu_milli));
        }
        if self.gpu_count > 0 && !(1..=MILLI_PER_GPU).contains(&self.gpu_milli) {
            return Err(format!("gpu_milli {} outside 1..=1000", self.gpu_milli));
        }
        if self.gpu_count > 1 && self.gpu_milli < MILLI_PER_GPU {
            return Err(format!("{} shared GPUs of {} milli: a shared GPU must be a single GPU", self.gpu_count, self.gpu_milli));
        }
        if self.gpu_count as usize > crate::units::MAX_GPUS_PER_NODE {
            return Err(format!("{} GPUs on one node exceeds {}", self.gpu_count, crate::units::MAX_GPUS_PER_NODE));
        }
        Ok(())
    }

    pub fn accepts(&self, model: Option<ModelId>) -> bool {
        match model {
            None => self.gpu_count == 0,
            Some(m) => self.models.is_empty() || self.models.contains(&m),
        }
    }
}

/// Identity and class of the task being placed, passed through to policies.
#[derive(Clone, Copy, Debug, Default)]
pub struct TaskMeta {
    pub job_id: u64,
    pub priority: u32,
    pub gang_size: u32,
    pub gang_index: u32,
    /// What kind of work it is (contract 0.4.0).
    pub class: berth_sdk::TaskClass,
}

/// Fills the contract's task record from a shape and its identity.
pub fn fill_task(t: &mut Task, shape: &TaskShape, meta: TaskMeta) {
    t.job_id = meta.job_id;
    t.gpu_count = shape.gpu_count;
    t.gpu_milli = shape.gpu_milli;
    t.cpu_milli = shape.cpu_milli;
    t.memory_mib = shape.memory_mib;
    t.models.clear();
    t.models.extend_from_slice(&shape.models);
    t.priority = meta.priority;
    t.gang_size = meta.gang_size.max(1);
    t.gang_index = meta.gang_index;
    t.class = meta.class;
}
