//! Quotes with a probability checked against what then happened, on a
//! small busy fleet: a small version of the ASI week's calibration.

mod common;

use berth_core::calibration::{calibrate, draw_probes, Settings};
use berth_core::engine::{Deciders, SimConfig};
use berth_core::{Fleet, Job, Node, TaskShape};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// 12 eight-GPU nodes kept busy: a stream of 1-, 2-, 4- and 8-GPU jobs,
/// exponential gaps and lognormal-ish run times in two classes (short
/// interactive work, long training) at about the fleet's size in demand.
fn busy_week(seed: u64) -> (Fleet, Vec<Job>, u64) {
    let nodes = 12;
    let fleet = Fleet::new(vec!["A".into()], (0..nodes).map(|i| Node::new(format!("n{i}"), Some(0), 8, 64_000, 512_000)).collect()).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let horizon = 4 * 86_400;
    let (mut t, mut jobs) = (0u64, Vec::new());
    while t < horizon {
        let long = rng.random_bool(0.3);
        let gpus = [1, 2, 4, 8][rng.random_range(0..4)];
        let mean_s = if long { 6.0 * 3600.0 } else { 1_800.0 };
        let duration = (-(1.0 - rng.random::<f64>()).ln() * mean_s) as u64 + 60;
        let shape = TaskShape { gpu_count: gpus, gpu_milli: 1000, cpu_milli: 1000 * gpus, memory_mib: 1024, models: vec![] };
        jobs.push(Job { id: jobs.len() as u64, class: u8::from(long), priority: if long { 1 } else { 5 }, arrival_s: t, duration_s: duration, tasks: 1, shape, ..Job::default() });
        // Demand about 1.05 times the fleet: queues form and clear.
        let mean_gap = (0.3 * 6.0 * 3600.0 + 0.7 * 1_800.0) * 3.75 / (1.05 * f64::from(nodes * 8));
        t += (-(1.0 - rng.random::<f64>()).ln() * mean_gap) as u64 + 1;
    }
    (fleet, jobs, horizon)
}

#[test]
fn quotes_come_true_as_often_as_they_say() {
    let (mut fleet, jobs, horizon) = busy_week(3);
    let settings = Settings {
        quotes: 400,
        from_s: 86_400,
        to_s: horizon,
        deadlines_s: vec![600, 1_800, 3_600, 4 * 3_600],
        samples: 200,
        window_s: 86_400,
        probe_run_s: 60,
        seed: 11,
    };
    let probes = draw_probes(&jobs, &settings);
    assert_eq!(probes.len(), 400);
    let mut policy = common::FirstFit;
    let config = SimConfig { horizon_s: horizon, high_priority: 5, ..SimConfig::default() };
    let c = calibrate(&mut fleet, &jobs, Deciders { placement: &mut policy, preemption: None, compaction: None }, config, &probes, &settings, None).unwrap();
    for (name, r) in [("asked", &c.asked), ("at spread", &c.at_spread)] {
        for b in &r.buckets {
            eprintln!("{name} {:.1}-{:.1}: {:>4} quotes, predicted {:.3}, observed {:.3}", b.from, b.to, b.quotes, b.predicted, b.observed);
        }
        eprintln!("{name}: brier {:.4} (base rate {:.4})", r.brier, r.brier_base_rate);
    }
    assert_eq!(c.quotes.len(), 400);
    // Not every quote is easy: some say no, some yes, some in between.
    let middling = c.quotes.iter().filter(|q| q.probability > 0.1 && q.probability < 0.9).count();
    assert!(middling >= 40, "{middling} quotes between 0.1 and 0.9");
    assert!(c.quotes.iter().any(|q| !q.on_time) && c.quotes.iter().any(|q| q.on_time));
    // Better than a quote that knows nothing of the moment, and each
    // decile with enough quotes close to what happened.
    assert!(c.asked.brier < 0.6 * c.asked.brier_base_rate, "{} vs {}", c.asked.brier, c.asked.brier_base_rate);
    let gap = c.asked.worst_gap(25).expect("deciles with quotes");
    assert!(gap <= 0.1, "worst decile gap {gap}");
    // The uncertain quotes, pooled: as many came true as they said.
    let middle: Vec<_> = c.quotes.iter().filter(|q| q.probability > 0.1 && q.probability < 0.9).collect();
    let said = middle.iter().map(|q| q.probability).sum::<f64>() / middle.len() as f64;
    let happened = middle.iter().filter(|q| q.on_time).count() as f64 / middle.len() as f64;
    assert!((said - happened).abs() <= 0.1, "between 0.1 and 0.9: said {said:.3}, happened {happened:.3}");
}

/// Each quote checked again at a deadline read off its own runs: the
/// second deadline never passes the one asked, its probability is what the
/// runs said for it, and the uncertain quotes spread over the deciles.
#[test]
fn quotes_checked_at_their_runs_spread_fill_the_deciles() {
    let (mut fleet, jobs, horizon) = busy_week(5);
    let settings = Settings { quotes: 300, from_s: 86_400, to_s: horizon, deadlines_s: vec![1_800, 4 * 3_600], samples: 200, window_s: 86_400, probe_run_s: 60, seed: 13 };
    let probes = draw_probes(&jobs, &settings);
    assert!(probes.iter().all(|p| p.spread > 0.0 && p.spread <= 1.0));
    let mut policy = common::FirstFit;
    let config = SimConfig { horizon_s: horizon, high_priority: 5, ..SimConfig::default() };
    let c = calibrate(&mut fleet, &jobs, Deciders { placement: &mut policy, preemption: None, compaction: None }, config, &probes, &settings, None).unwrap();
    for q in &c.quotes {
        assert!(q.spread_deadline_s <= q.deadline_s, "{q:?}");
        assert!(q.spread_probability <= q.probability + 1e-9, "an earlier deadline cannot be likelier: {q:?}");
        assert_eq!(q.spread_on_time, q.started_after_s.is_some_and(|s| s <= q.spread_deadline_s));
    }
    let said = |from: f64, to: f64| c.quotes.iter().filter(|q| q.spread_probability > from && q.spread_probability < to).count();
    let (asked_middle, spread_middle) = (c.quotes.iter().filter(|q| q.probability > 0.1 && q.probability < 0.9).count(), said(0.1, 0.9));
    assert!(spread_middle > asked_middle, "the spread check fills the middle: {spread_middle} against {asked_middle}");
    for r in [&c.asked, &c.at_spread] {
        assert_eq!(r.buckets.iter().map(|b| b.quotes).sum::<u32>(), 300);
    }
    assert!(c.at_spread.brier < c.at_spread.brier_base_rate, "{:?}", c.at_spread);
    if let Some(gap) = c.at_spread.worst_gap(25) {
        assert!(gap <= 0.12, "worst decile gap at the spread deadlines: {gap}");
    }
}

/// Runs answer for every earlier deadline: the starts by then, and the
/// deadline at a rank is the start of that run.
#[test]
fn runs_answer_for_earlier_deadlines() {
    use berth_core::forecast::{Runs, Start};
    let runs = Runs::new(10, [300, 100, 200, 100].into_iter().map(|at_s| Start { at_s, rate: 1.0 }).collect());
    assert_eq!(runs.chance().started, 4);
    assert_eq!(runs.within(150).started, 2);
    assert_eq!(runs.within(99).probability, 0.0);
    assert_eq!(runs.within(300).probability, 0.4);
    assert_eq!(runs.deadline_at(0.01, 900), 100, "the first run's start");
    assert_eq!(runs.deadline_at(0.3, 900), 200, "the third run's start");
    assert_eq!(runs.deadline_at(0.5, 900), 900, "fewer than half started: the deadline asked");
}
