//! The ground vocabulary every other module counts in: node and model
//! indices and GPU units. Nothing here depends on another module, so the
//! fleet, tasks and jobs can all name them without importing each other.

/// Index of a GPU model in [`crate::fleet::Fleet::models`].
pub type ModelId = u32;
/// Index of a node in [`crate::fleet::Fleet::nodes`].
pub type NodeId = u32;

/// Thousandths of one GPU in a whole GPU.
pub const MILLI_PER_GPU: u32 = 1000;
/// Most GPUs a node may hold (GPU sets cross the boundary as u64 masks).
pub const MAX_GPUS_PER_NODE: usize = 64;
