//! The event replay's report as one self-contained HTML page: each run's
//! allocation beside its outcome (goodput per installed GPU-hour and per
//! cost, work lost), the runs ranked both ways, and the calibration of
//! quotes when one was run.

use std::fmt::Write;

use super::calibration::Calibrated;
use berth_core::calibration::Reliability;
use super::report::ReplayOutcome;
use crate::replay::report::{escape_html as e, STYLE};

/// One run of the report: its name, allocation % (all, high priority) and
/// outcome.
pub struct RunRow<'a> {
    pub name: &'a str,
    pub allocation_pct: f64,
    pub high_priority_allocation_pct: f64,
    pub outcome: &'a ReplayOutcome,
}

/// The page. `setting` says what was replayed (fleet, jobs, days).
pub fn page(setting: &str, runs: &[RunRow<'_>], calibration: Option<&Calibrated>) -> Result<String, std::fmt::Error> {
    let mut h = String::new();
    write!(h, "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>Berth fleet replay</title>\n<style>{STYLE}</style>\n</head>\n<body>\n")?;
    writeln!(h, "<h1>Berth fleet replay</h1>\n<p class=\"meta\">{}</p>", e(setting))?;
    if !runs.is_empty() {
        writeln!(h, "<h2>Outcome beside allocation</h2>")?;
        writeln!(h, "<p>Goodput is work done and kept, in reference GPU-hours (a run on a slower model, or across switch domains, does less in an hour); work lost to preemption is done again.</p>")?;
        writeln!(h, "<table id=\"runs\">\n<thead><tr><th>run</th><th>allocation %</th><th>high priority %</th><th>goodput / installed GPU-h</th><th>goodput / cost</th><th>goodput GPU-h</th><th>lost GPU-h</th><th>rank by outcome</th><th>rank by allocation</th></tr></thead>\n<tbody>")?;
        let rank = |key: &dyn Fn(&RunRow) -> f64, i: usize| 1 + runs.iter().filter(|r| key(r) > key(&runs[i])).count();
        for (i, r) in runs.iter().enumerate() {
            writeln!(
                h,
                "<tr><th scope=\"row\">{}</th><td>{:.2}</td><td>{:.2}</td><td>{:.4}</td><td>{}</td><td>{:.0}</td><td>{:.0}</td><td>{}</td><td>{}</td></tr>",
                e(r.name),
                r.allocation_pct,
                r.high_priority_allocation_pct,
                r.outcome.per_installed_gpu_hour,
                r.outcome.per_cost.map_or("-".into(), |c| format!("{c:.4}")),
                r.outcome.goodput_gpu_h,
                r.outcome.lost_gpu_h,
                rank(&|r| r.outcome.per_installed_gpu_hour, i),
                rank(&|r| r.allocation_pct, i),
            )?;
        }
        writeln!(h, "</tbody>\n</table>")?;
    }
    if let Some(run) = calibration {
        let c = &run.calibration;
        writeln!(h, "<h2>Calibration of quotes</h2>")?;
        writeln!(
            h,
            "<p>{} quotes of {} runs forward each, asked at random moments for the shapes of random jobs, each checked against its copy's start at the deadline asked and at a deadline read off its own runs. Time per quote on {} nodes: p50 {:.0} ms, p99 {:.0} ms.</p>",
            c.quotes.len(),
            c.samples,
            run.nodes,
            run.quote_ms_p50,
            run.quote_ms_p99
        )?;
        reliability(&mut h, "reliability", "At the deadlines asked (10 min to 8 h)", &c.asked)?;
        reliability(&mut h, "reliability-spread", "At a deadline read off each quote's runs (the start at a random rank)", &c.at_spread)?;
    }
    writeln!(h, "<footer>Written by berth {}.</footer>\n</body>\n</html>", env!("CARGO_PKG_VERSION"))?;
    Ok(h)
}

/// One reliability table: deciles of predicted probability against the
/// share that started in time.
fn reliability(h: &mut String, id: &str, caption: &str, r: &Reliability) -> std::fmt::Result {
    writeln!(h, "<table id=\"{id}\">\n<caption>{caption}: Brier score {:.4}, always saying the base rate {:.4}</caption>", r.brier, r.brier_base_rate)?;
    writeln!(h, "<thead><tr><th>predicted</th><th>quotes</th><th>mean predicted</th><th>started in time</th><th>gap (points)</th></tr></thead>\n<tbody>")?;
    for b in &r.buckets {
        if b.quotes == 0 {
            writeln!(h, "<tr><th scope=\"row\">{:.1}-{:.1}</th><td>0</td><td>-</td><td>-</td><td>-</td></tr>", b.from, b.to)?;
        } else {
            writeln!(
                h,
                "<tr><th scope=\"row\">{:.1}-{:.1}</th><td>{}</td><td>{:.3}</td><td>{:.3}</td><td>{:+.1}</td></tr>",
                b.from,
                b.to,
                b.quotes,
                b.predicted,
                b.observed,
                100.0 * (b.observed - b.predicted)
            )?;
        }
    }
    writeln!(h, "</tbody>\n</table>")
}
