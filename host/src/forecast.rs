//! Quotes with a probability, run on the host: the core's forecast
//! ([`berth_core::forecast`]) with its runs forward spread over the
//! machine's cores and stopped when a time budget is spent. `berth quote`
//! and the replay's calibration both use it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use berth_core::accounting::PendingShape;
use berth_core::forecast::{self, Chance, Forecast, History, Now, Runs, Start};

static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The chance of one copy of `request` starting within `deadline_s`, over
/// at most `samples` runs spread over the machine's cores, stopping when
/// `budget` is spent (the answer says how many ran).
pub fn chance_within(now: Now<'_>, request: &PendingShape, history: &History, deadline_s: u64, samples: u32, seed: u64, budget: Duration) -> Chance {
    runs_within(now, request, history, deadline_s, samples, seed, budget).chance()
}

/// The runs of [`chance_within`], for a caller that asks about earlier
/// deadlines too.
pub fn runs_within(now: Now<'_>, request: &PendingShape, history: &History, deadline_s: u64, samples: u32, seed: u64, budget: Duration) -> Runs {
    // One forecast at a time on this host: a flood of quotes waits its
    // turn instead of taking every core at once; each budget starts when
    // its turn comes.
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let started_at = std::time::Instant::now();
    let forecast = Forecast::new(now, request, history, deadline_s, seed);
    let samples = samples.clamp(1, forecast::MAX_SAMPLES);
    let next = AtomicU32::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 8);
    let (starts, ran): (Vec<Start>, u32) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let (mut starts, mut ran) = (Vec::new(), 0u32);
                    loop {
                        // At least one sample, then while time is left.
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= samples || (i > 0 && started_at.elapsed() >= budget) {
                            break;
                        }
                        ran += 1;
                        starts.extend(forecast.run(i));
                    }
                    (starts, ran)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("a forecast worker")).fold((Vec::new(), 0), |(mut all, n), (s, r)| {
            all.extend(s);
            (all, n + r)
        })
    });
    Runs::new(ran, starts)
}
