//! A tracked fleet (the live host's) knows its outstanding allocations: a
//! release must name one, which capacity alone cannot tell when two
//! holders share a GPU.

use berth_core::fleet::FleetError;
use berth_core::{Allocation, Fleet, Node};

fn fleet(tracked: bool) -> Fleet {
    let mut f = Fleet::new(vec!["A".into()], vec![Node::new("n0", Some(0), 8, 64_000, 512_000), Node::new("n1", Some(0), 8, 64_000, 512_000)]).unwrap();
    if tracked {
        f.track_allocations();
    }
    f
}

fn share(node: u32, gpus: u64, gpu_milli: u32, cpu_milli: u32) -> Allocation {
    Allocation { node, gpus, gpu_milli, cpu_milli, memory_mib: 1024 }
}

/// Two jobs share GPU 3: the first releases its share twice. Capacity
/// allows the second release (the other job's share is there to take);
/// the ledger does not, and nothing changes.
#[test]
fn a_second_release_of_a_share_fails_while_another_holder_is_on_the_gpu() {
    let (a, b) = (share(0, 1 << 3, 400, 1000), share(0, 1 << 3, 500, 2000));
    let mut untracked = fleet(false);
    let mut tracked = fleet(true);
    for f in [&mut untracked, &mut tracked] {
        f.allocate(&a).unwrap();
        f.allocate(&b).unwrap();
        f.release(&a).unwrap();
    }
    // Capacity only: the second release takes from b's share, silently.
    let a_small = share(0, 1 << 3, 400, 1000);
    assert!(untracked.release(&a_small).is_ok(), "an untracked fleet checks capacity only");
    let before = tracked.nodes()[0].clone();
    let e = tracked.release(&a_small).unwrap_err();
    assert_eq!(e, FleetError::NotOutstanding { node: 0, gpus: 1 << 3, gpu_milli: 400 });
    assert!(e.to_string().contains("not outstanding"), "{e}");
    assert_eq!(tracked.nodes()[0], before, "a refused release changes nothing");
    assert_eq!(tracked.outstanding(), Some(1));
    tracked.release(&b).unwrap();
    assert_eq!(tracked.outstanding(), Some(0));
    tracked.check_invariants().unwrap();
}

/// Identical allocations are counted: each may be released once.
#[test]
fn identical_allocations_are_released_once_each() {
    let mut f = fleet(true);
    let a = share(1, 1 << 0, 250, 500);
    for _ in 0..3 {
        f.allocate(&a).unwrap();
    }
    for _ in 0..3 {
        f.release(&a).unwrap();
    }
    assert!(matches!(f.release(&a), Err(FleetError::NotOutstanding { .. })));
    f.check_invariants().unwrap();
}

/// A clone is a scratch view without the ledger; replacing the nodes keeps
/// it.
#[test]
fn clones_are_untracked_and_a_node_added_keeps_the_ledger() {
    let mut f = fleet(true);
    let whole = share(0, 0xff, 1000, 8000);
    f.allocate(&whole).unwrap();
    let scratch = f.clone();
    assert_eq!(scratch.outstanding(), None);
    f.put_node(f.models.clone(), None, Node::new("n2", Some(0), 4, 32_000, 256_000)).unwrap();
    assert_eq!(f.outstanding(), Some(1));
    f.check_invariants().unwrap();
    f.release(&whole).unwrap();
    assert!(matches!(f.release(&whole), Err(FleetError::NotOutstanding { .. })));
}

/// The invariant check compares each node's use with its outstanding
/// allocations: a node put back in use that no allocation explains is
/// caught.
#[test]
fn use_no_outstanding_allocation_explains_is_an_invariant_break() {
    let mut f = fleet(true);
    let a = share(0, 0b11, 1000, 1000);
    f.allocate(&a).unwrap();
    let mut other = fleet(false);
    other.allocate(&share(1, 0b1, 1000, 1000)).unwrap();
    // n1 comes back with a GPU in use that the ledger never saw.
    f.put_node(f.models.clone(), Some(1), other.nodes()[1].clone()).unwrap();
    let e = f.check_invariants().unwrap_err();
    assert!(e.contains("node n1") && e.contains("outstanding"), "{e}");
}

/// A node added in place (a registering agent) keeps the outstanding
/// allocations and their ledger, and the totals follow; an idle node
/// redefined replaces its capacity; a bad node or a model list that does
/// not extend the current one changes nothing.
#[test]
fn a_node_put_in_place_keeps_the_ledger_and_the_totals_follow() {
    let mut f = fleet(true);
    let held = share(0, 0b11, 1000, 1000);
    f.allocate(&held).unwrap();
    let before = (f.gpu_total_milli(), f.gpu_allocated_milli());
    let id = f.put_node(vec!["A".into(), "B".into()], None, Node::new("n2", Some(1), 4, 64_000, 512_000)).unwrap();
    assert_eq!(id, 2);
    assert_eq!((f.gpu_total_milli(), f.gpu_allocated_milli()), (before.0 + 4000, before.1));
    // Redefined: n2 now has 2 GPUs.
    assert_eq!(f.put_node(vec!["A".into(), "B".into()], Some(2), Node::new("n2", Some(1), 2, 64_000, 512_000)).unwrap(), 2);
    assert_eq!(f.gpu_total_milli(), before.0 + 2000);
    // Refused without a change: an unknown model, a reordered model list.
    assert!(f.put_node(vec!["A".into(), "B".into()], None, Node::new("n3", Some(5), 8, 64_000, 512_000)).is_err());
    assert!(f.put_node(vec!["B".into(), "A".into()], None, Node::new("n3", Some(0), 8, 64_000, 512_000)).is_err());
    assert_eq!((f.nodes().len(), f.gpu_total_milli()), (3, before.0 + 2000));
    // The allocation made before is still the ledger's: released once, not twice.
    f.release(&held).unwrap();
    assert!(f.release(&held).is_err());
}

/// The fleet's state digest is kept as nodes change: it names the state,
/// not the history (an allocation released again gives the digest back),
/// tells states apart, and a fleet built from the same nodes agrees.
#[test]
fn the_state_digest_follows_every_change_and_names_the_state() {
    let mut f = fleet(true);
    let empty = f.state_digest();
    assert_eq!(fleet(false).state_digest(), empty, "equal fleets, equal digests");
    let a = share(1, 0b11, 1000, 4000);
    f.allocate(&a).unwrap();
    let held = f.state_digest();
    assert_ne!(held, empty, "an allocation changes the digest");
    // The same capacity taken on the other node is another state.
    let mut g = fleet(true);
    g.allocate(&share(0, 0b11, 1000, 4000)).unwrap();
    assert_ne!(g.state_digest(), held, "the node is part of the state");
    f.set_schedulable(0, false).unwrap();
    assert_ne!(f.state_digest(), held, "cordoning changes the digest");
    f.set_schedulable(0, true).unwrap();
    assert_eq!(f.state_digest(), held);
    assert_eq!(f.clone().state_digest(), held, "a scratch copy keeps it");
    f.put_node(vec!["A".into()], None, Node::new("n2", Some(0), 8, 64_000, 512_000)).unwrap();
    assert_ne!(f.state_digest(), held, "an added node changes it");
    f.check_invariants().unwrap();
    f.release(&a).unwrap();
    let rebuilt = Fleet::new(vec!["A".into()], f.nodes().to_vec()).unwrap();
    assert_eq!(f.state_digest(), rebuilt.state_digest(), "kept as it changed = computed from scratch");
}

/// Releasing many at once is releasing them one by one: the same nodes,
/// digest and free summaries (brought up to date once per node); a bad one
/// stops the batch with those before it returned and the fleet consistent;
/// a scratch view written into old memory equals a fresh clone.
#[test]
fn a_batch_release_equals_one_by_one_and_stops_consistent_at_a_bad_one() {
    let allocs = [share(0, 0b1, 1000, 1000), share(0, 0b110, 500, 2000), share(1, 0b11, 1000, 4000), share(1, 0b100, 250, 500)];
    let mut one = fleet(true);
    let mut many = fleet(true);
    for f in [&mut one, &mut many] {
        for a in &allocs {
            f.allocate(a).unwrap();
        }
    }
    for a in &allocs[..3] {
        one.release(a).unwrap();
    }
    many.release_all(&allocs[..3]).unwrap();
    assert_eq!(many.nodes(), one.nodes());
    assert_eq!(many.state_digest(), one.state_digest());
    assert_eq!(many.free_summaries(), one.free_summaries());
    many.check_invariants().unwrap();
    // allocs[0] again is not outstanding: allocs[3] before it is returned.
    let e = many.release_all([&allocs[3], &allocs[0], &allocs[1]]).unwrap_err();
    assert_eq!(e, FleetError::NotOutstanding { node: 0, gpus: 0b1, gpu_milli: 1000 });
    one.release(&allocs[3]).unwrap();
    assert_eq!(many.nodes(), one.nodes());
    assert_eq!(many.state_digest(), one.state_digest());
    many.check_invariants().unwrap();
    let mut view = fleet(false);
    view.put_node(vec!["A".into()], None, Node::new("a much longer node name", Some(0), 4, 1000, 1000)).unwrap();
    view.clone_from(&many);
    assert_eq!(view.nodes(), many.clone().nodes());
    assert_eq!((view.state_digest(), view.free_summaries()), (many.state_digest(), many.free_summaries()));
}
