//! topo-entropy: topology-aware packing for gangs and everything else.
//!
//! Gangs (contract 0.2.0 `score-domains`): a domain that holds the whole
//! gang beats any that does not; among those, the one that leaves the free
//! capacity for this shape most concentrated wins, measured by the entropy of
//! free capacity over domains after placing (finishing off a small free
//! fragment lowers it, cutting into a large free domain raises it). A gang
//! that fits no single domain takes the largest ones first, so it spans as
//! few as possible.
//!
//! Tasks (`score`): pack onto the fullest node, and prefer busy domains so
//! idle switch domains stay whole for future gangs.

mod score;

pub use score::TopoEntropy;

berth_sdk::export!(TopoEntropy);
