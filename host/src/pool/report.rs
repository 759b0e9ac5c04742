//! The pool comparison as a table (beside Aegaeon's published figures),
//! JSON and SVG.

use std::fmt::Write;
use std::path::Path;

use super::{Comparison, PolicyReport};

fn find<'a>(c: &'a Comparison, name: &str) -> Option<&'a PolicyReport> {
    c.policies.iter().find(|p| p.policy == name)
}

fn layout(l: &[(u32, u32)]) -> String {
    l.iter().map(|(tp, n)| format!("{n}x{tp}")).collect::<Vec<_>>().join("+")
}

/// The per-policy table and the comparison with Aegaeon's figures.
pub fn table(c: &Comparison) -> String {
    let mut s = String::new();
    let dedicated = find(c, "pool-dedicated").and_then(|p| p.gpus_needed);
    let request_level = find(c, "pool-scale-to-zero").map(|p| p.max_rate_multiplier);
    let _ = writeln!(
        s,
        "{} | seed {} | {} requests, {:.2} req/s | SLO: TTFT {:.1} s, TBT {:.0} ms, {:.0}% attainment",
        c.source,
        c.seed,
        c.requests,
        c.base_rate_rps,
        c.slo.ttft_s,
        c.slo.tbt_s * 1000.0,
        c.slo.target * 100.0
    );
    let _ = writeln!(
        s,
        "SLO %, goodput (req/s meeting the SLO), max rate (req/s at {:.0}% attainment) measured on a fixed pool of {} GPUs ({} executors x TP)",
        c.slo.target * 100.0,
        c.fixed_gpus,
        layout(&c.fixed_layout)
    );
    let _ = writeln!(
        s,
        "{:<20} {:>5} {:>7} {:>9} | {:>6} {:>7} {:>8} {:>7} | {:>7} {:>8} {:>8} {:>8} {:>6}",
        "policy", "GPUs", "vs ded", "executors", "SLO %", "goodput", "max rate", "vs req", "models", "switches", "TB moved", "switch %", "time"
    );
    for p in &c.policies {
        let gpus = p.gpus_needed.map_or("-".into(), |g| g.to_string());
        let vs = match (p.gpus_needed, dedicated) {
            (Some(g), Some(d)) if d > 0 => format!("{:+.0}%", (g as f64 / d as f64 - 1.0) * 100.0),
            _ => "-".into(),
        };
        let vs_req = match request_level {
            Some(r) if r > 0.0 => format!("{:.2}x", p.max_rate_multiplier / r),
            _ => "-".into(),
        };
        let f = &p.at_fixed;
        let switch_share = if f.busy_s > 0.0 { f.switch_s / f.busy_s * 100.0 } else { 0.0 };
        let _ = writeln!(
            s,
            "{:<20} {:>5} {:>7} {:>9} | {:>6.2} {:>7.2} {:>8.2} {:>7} | {:>7} {:>8} {:>8.2} {:>7.1}% {:>5.1}s",
            p.policy,
            gpus,
            vs,
            p.layout_needed.as_deref().map_or("-".into(), layout),
            f.attainment * 100.0,
            f.goodput_rps,
            p.max_rate_rps,
            vs_req,
            format!("{}/{:.1}", p.at_needed.models_per_executor_max, p.at_needed.models_per_executor_mean),
            p.at_needed.switches,
            p.at_needed.bytes_moved as f64 / 1e12,
            switch_share,
            p.seconds,
        );
    }
    let _ = writeln!(
        s,
        "(GPUs: needed for {:.0}% attainment, executors as count x TP; models: distinct models one executor ran, most/mean, at the GPUs needed; switches and TB moved: weight loads at the GPUs needed; switch %: load time / busy time at the fixed pool)",
        c.slo.target * 100.0
    );
    s
}

/// The headline figures of one seed.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Headline {
    pub seed: u64,
    pub dedicated_gpus: Option<u32>,
    pub token_gpus: Option<u32>,
    /// 1 - token / dedicated GPUs.
    pub reduction: Option<f64>,
    /// Token-level over request-level sustained arrival rate.
    pub rate_vs_request_level: Option<f64>,
    pub rate_vs_muxserve: Option<f64>,
}

pub fn headline(c: &Comparison) -> Headline {
    let gpus = |name: &str| find(c, name).and_then(|p| p.gpus_needed);
    let rate = |name: &str| find(c, name).map(|p| p.max_rate_multiplier);
    let (d, t) = (gpus("pool-dedicated"), gpus("pool-token"));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    Headline {
        seed: c.seed,
        dedicated_gpus: d,
        token_gpus: t,
        reduction: match (d, t) {
            (Some(d), Some(t)) if d > 0 => Some(1.0 - f64::from(t) / f64::from(d)),
            _ => None,
        },
        rate_vs_request_level: ratio(rate("pool-token"), rate("pool-scale-to-zero")),
        rate_vs_muxserve: ratio(rate("pool-token"), rate("pool-muxserve")),
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// The first seed's table, one headline line per seed, and the medians
/// beside Aegaeon's published figures.
pub fn report(all: &[Comparison]) -> String {
    let mut s = String::new();
    let Some(first) = all.first() else { return s };
    s.push_str(&table(first));
    let heads: Vec<Headline> = all.iter().map(headline).collect();
    let pct = |x: Option<f64>| x.map_or("-".into(), |x| format!("{:.0}%", x * 100.0));
    let times = |x: Option<f64>| x.map_or("-".into(), |x| if x.is_finite() { format!("{x:.2}x") } else { "inf".into() });
    let _ = writeln!(s, "\n{:>6} {:>10} {:>7} {:>10} {:>14} {:>14}", "seed", "dedicated", "token", "reduction", "rate vs req.", "rate vs mux");
    for h in &heads {
        let _ = writeln!(
            s,
            "{:>6} {:>10} {:>7} {:>10} {:>14} {:>14}",
            h.seed,
            h.dedicated_gpus.map_or("-".into(), |g| g.to_string()),
            h.token_gpus.map_or("-".into(), |g| g.to_string()),
            pct(h.reduction),
            times(h.rate_vs_request_level),
            times(h.rate_vs_muxserve),
        );
    }
    let reductions: Vec<f64> = heads.iter().filter_map(|h| h.reduction).collect();
    let rates: Vec<f64> = heads.iter().filter_map(|h| h.rate_vs_request_level).collect();
    let goal_gpus = reductions.iter().filter(|&&r| r >= 0.8).count();
    let goal_rate = rates.iter().filter(|&&r| r >= 2.0).count();
    let _ = writeln!(
        s,
        "goal (>= 80% fewer GPUs than dedicated; >= 2x request-level's rate): GPUs met in {goal_gpus}/{n} seeds, rate met in {goal_rate}/{n} seeds (rate vs mux \"-\": muxserve cannot hold the catalog on that pool)",
        n = heads.len()
    );
    let dedicated = median(heads.iter().filter_map(|h| h.dedicated_gpus.map(f64::from)).collect());
    let token = median(heads.iter().filter_map(|h| h.token_gpus.map(f64::from)).collect());
    let label = if all.len() > 1 { format!("Berth (median of {} seeds)", all.len()) } else { "Berth (this run)".into() };
    let _ = writeln!(s, "\n{:<36} {:>28} {:>30}", "", "Aegaeon (SOSP'25, published)", label);
    let gpus_line = match (dedicated, token, median(reductions.clone())) {
        (Some(d), Some(t), Some(r)) => format!("{d:.0} -> {t:.0} (-{:.0}%)", r * 100.0),
        _ => "not reached".into(),
    };
    let _ = writeln!(s, "{:<36} {:>28} {:>30}", "GPUs, dedicated -> token-level", "1,192 -> 213 (-82%)", gpus_line);
    let models = find(first, "pool-token").map_or("-".into(), |t| {
        let gpus = t.gpus_needed.unwrap_or(0).max(1);
        format!("{:.1} avg (seed {}: {} models / {} GPUs)", first.models as f64 / f64::from(gpus), first.seed, first.models, gpus)
    });
    let _ = writeln!(s, "{:<36} {:>28} {:>30}", "models per GPU", "up to 7", models);
    if let Some(t) = find(first, "pool-token") {
        let _ = writeln!(
            s,
            "{:<36} {:>28} {:>30}",
            "  (one executor over the run)",
            "",
            format!("up to {} ran, {} resident at once", t.at_needed.models_per_executor_max, t.at_needed.resident_max)
        );
    }
    let _ = writeln!(s, "{:<36} {:>28} {:>30}", "arrival rate vs request-level", "2-2.5x", times(median(rates)));
    let mux: Vec<f64> = heads.iter().filter_map(|h| h.rate_vs_muxserve).collect();
    let mux_none = all.iter().filter(|c| find(c, "pool-muxserve").is_some_and(|m| m.max_rate_multiplier == 0.0)).count();
    let mux_line = if mux_none > 0 {
        format!("{} ({mux_none}/{} seeds: mux holds none)", times(median(mux)), all.len())
    } else {
        times(median(mux))
    };
    let _ = writeln!(s, "{:<36} {:>28} {:>30}", "arrival rate vs static multiplexing", "2-2.5x", mux_line);
    let per_switch = find(first, "pool-token")
        .filter(|t| t.at_needed.switches > 0)
        .map_or("-".into(), |t| format!("{:.2} s per switch (an input)", t.at_needed.switch_s / t.at_needed.switches as f64));
    let _ = writeln!(s, "{:<36} {:>28} {:>30}", "switching overhead", "-97%", per_switch);
    let total: f64 = all.iter().map(|c| c.seconds).sum();
    let _ = writeln!(s, "{} seed(s) in {:.1} s", all.len(), total);
    s
}

/// Every seed's comparison and headline.
pub fn write_json(path: &Path, all: &[Comparison]) -> anyhow::Result<()> {
    let heads: Vec<Headline> = all.iter().map(headline).collect();
    let value = serde_json::json!({ "comparisons": all, "headlines": heads });
    std::fs::write(path, serde_json::to_string_pretty(&value)?).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    Ok(())
}

/// Two bar charts: GPUs needed for the target, and the highest arrival
/// rate the fixed pool sustains.
pub fn write_svg(path: &Path, c: &Comparison) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (1000, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(500);
    let n = c.policies.len();
    let names: Vec<String> = c.policies.iter().map(|p| p.policy.trim_start_matches("pool-").to_string()).collect();
    let bars = |area: &DrawingArea<SVGBackend, plotters::coord::Shift>, title: &str, y: &str, values: Vec<f64>| -> anyhow::Result<()> {
        let y_max = values.iter().copied().fold(1.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(55)
            .build_cartesian_2d(0f64..n as f64, 0f64..y_max)?;
        let labels = names.clone();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n * 2 + 1)
            .x_label_formatter(&move |x| {
                let i = x.floor() as usize;
                if (x - i as f64 - 0.5).abs() < 0.01 && i < labels.len() { labels[i].clone() } else { String::new() }
            })
            .y_desc(y)
            .draw()?;
        for (i, v) in values.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart.draw_series(std::iter::once(Rectangle::new([(i as f64 + 0.15, 0.0), (i as f64 + 0.85, *v)], color.filled())))?;
            chart.draw_series(std::iter::once(Text::new(format!("{v:.1}"), (i as f64 + 0.3, v + y_max * 0.02), ("sans-serif", 14))))?;
        }
        Ok(())
    };
    let gpus: Vec<f64> = c.policies.iter().map(|p| p.gpus_needed.map_or(0.0, f64::from)).collect();
    bars(&left, &format!("GPUs needed for {:.0}% SLO attainment", c.slo.target * 100.0), "GPUs", gpus)?;
    let rates: Vec<f64> = c.policies.iter().map(|p| p.max_rate_rps).collect();
    bars(&right, &format!("Sustained arrival rate on {} GPUs", c.fixed_gpus), "requests / s", rates)?;
    root.present()?;
    Ok(())
}
