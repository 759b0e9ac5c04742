//! Aggregating replay curves over seeds, and the outputs: a side-by-side
//! table, JSON, and an SVG plot.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

/// The outcome of a replay.
#[derive(Debug, Serialize)]
pub struct ReplayOutcome {
    /// Policy names in the order given.
    pub policies: Vec<String>,
    pub rows: Vec<ResultRow>,
    /// Per (policy, seed): pods offered and placed, final unallocated %.
    pub runs: Vec<RunSummary>,
}

#[derive(Debug, Serialize, Clone)]
pub struct RunSummary {
    pub policy: String,
    pub seed: u64,
    pub pods_offered: usize,
    pub pods_placed: usize,
    pub final_unallocated_pct: f64,
}

/// Highest arrival point recorded, in % of cluster GPU capacity.
pub const MAX_ARRIVAL_PCT: usize = 130;
/// The arrival points of the summary table.
pub const TABLE_POINTS: [usize; 5] = [90, 95, 100, 110, 130];

/// One policy at one arrival point, over seeds.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ResultRow {
    pub policy: String,
    pub arrived_pct: usize,
    pub unallocated_pct_mean: f64,
    pub unallocated_pct_min: f64,
    pub unallocated_pct_max: f64,
    pub seeds: usize,
}

/// Unallocated GPU % at each arrival point 0..=130 of one run; `None` where
/// the run recorded nothing (it can stop early when the pod list ends).
pub type Curve = Vec<Option<f64>>;

/// Mean, min and max over the seeds that reached each point.
pub fn aggregate(policy: &str, curves: &[Curve]) -> Vec<ResultRow> {
    (1..=MAX_ARRIVAL_PCT)
        .filter_map(|pct| {
            let values: Vec<f64> = curves.iter().filter_map(|c| c.get(pct).copied().flatten()).collect();
            if values.is_empty() {
                return None;
            }
            let mean = values.iter().sum::<f64>() / values.len() as f64;
            Some(ResultRow {
                policy: policy.to_string(),
                arrived_pct: pct,
                unallocated_pct_mean: round3(mean),
                unallocated_pct_min: values.iter().copied().fold(f64::INFINITY, f64::min),
                unallocated_pct_max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                seeds: values.len(),
            })
        })
        .collect()
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Published means keyed by (policy, arrival %), for side-by-side tables.
pub type Published = BTreeMap<(String, usize), f64>;

/// The FGD paper's name for a Berth policy, as in the published CSV.
pub fn published_name(policy: &str) -> Option<&'static str> {
    Some(match policy {
        "random" => "01-Random",
        "dotprod" => "02-DotProd",
        "gpu-clustering" => "03-GpuClustering",
        "gpu-packing" => "04-GpuPacking",
        "best-fit" => "05-BestFit",
        "fgd" => "06-FGD",
        _ => return None,
    })
}

/// Reads the published table for one workload (e.g. `openb_pod_list_default`)
/// from `fgd_published_unallocated.csv`. Keys use Berth's policy names.
pub fn read_published(path: &Path, workload: &str) -> anyhow::Result<Published> {
    let mut reader = csv::Reader::from_path(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let mut out = Published::new();
    let names = ["random", "dotprod", "gpu-clustering", "gpu-packing", "best-fit", "fgd"];
    for (i, record) in reader.records().enumerate() {
        let r = record.map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        if r.get(0) != Some(workload) {
            continue;
        }
        let line = i + 2;
        let field = |k: usize| r.get(k).ok_or_else(|| anyhow::anyhow!("{}:{line}: missing column {}", path.display(), k + 1));
        let Some(ours) = names.iter().find(|n| published_name(n) == Some(field(1).unwrap_or(""))) else { continue };
        let pct: usize = field(2)?.parse().map_err(|e| anyhow::anyhow!("{}:{line}: arrived_pct: {e}", path.display()))?;
        let mean: f64 = field(3)?.parse().map_err(|e| anyhow::anyhow!("{}:{line}: unallocated_pct_mean: {e}", path.display()))?;
        out.insert((ours.to_string(), pct), mean);
    }
    Ok(out)
}

/// The side-by-side table: mean [min, max] per policy at the table points,
/// with the published mean beneath when known.
pub fn table(rows: &[ResultRow], policies: &[String], published: &Published) -> String {
    let mut out = String::new();
    out.push_str(&format!("{:<16}", "unallocated %"));
    for p in TABLE_POINTS {
        out.push_str(&format!("{:>22}", format!("arrived {p}%")));
    }
    out.push('\n');
    for policy in policies {
        out.push_str(&format!("{policy:<16}"));
        for p in TABLE_POINTS {
            let cell = rows
                .iter()
                .find(|r| &r.policy == policy && r.arrived_pct == p)
                .map(|r| format!("{:.2} [{:.2},{:.2}]", r.unallocated_pct_mean, r.unallocated_pct_min, r.unallocated_pct_max))
                .unwrap_or_else(|| "-".into());
            out.push_str(&format!("{cell:>22}"));
        }
        out.push('\n');
        if published.keys().any(|(n, _)| n == policy) {
            out.push_str(&format!("{:<16}", "  published"));
            for p in TABLE_POINTS {
                let cell = published.get(&(policy.clone(), p)).map(|m| format!("{m:.2}")).unwrap_or_else(|| "-".into());
                out.push_str(&format!("{cell:>22}"));
            }
            out.push('\n');
        }
    }
    out
}

/// Writes `{"policy_config": {...}, "results": [...]}`; the settings
/// `--policy-config` added (left out when none) keep a sweep's files
/// attributable.
pub fn write_json(path: &Path, rows: &[ResultRow], policy_config: &serde_json::Map<String, serde_json::Value>) -> anyhow::Result<()> {
    #[derive(Serialize)]
    struct Doc<'a> {
        #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
        policy_config: &'a serde_json::Map<String, serde_json::Value>,
        results: &'a [ResultRow],
    }
    let text = serde_json::to_string_pretty(&Doc { policy_config, results: rows })?;
    std::fs::write(path, text).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))
}

/// Draws unallocated % against arrival % for each policy.
pub fn write_svg(path: &Path, title: &str, rows: &[ResultRow], policies: &[String]) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let y_max = rows.iter().map(|r| r.unallocated_pct_mean).fold(1.0, f64::max).min(100.0);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..MAX_ARRIVAL_PCT as f64, 0f64..y_max * 1.05)?;
    chart.configure_mesh().x_desc("arrived GPU demand, % of capacity").y_desc("unallocated GPU %").draw()?;
    for (i, policy) in policies.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let points: Vec<(f64, f64)> =
            rows.iter().filter(|r| &r.policy == policy).map(|r| (r.arrived_pct as f64, r.unallocated_pct_mean)).collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(policy.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw()?;
    root.present()?;
    Ok(())
}

/// What the HTML report says about the run besides its results.
pub struct HtmlMeta<'a> {
    /// The pod list's name, or the generated trace.
    pub source: &'a str,
    pub seeds: &'a [u64],
    /// `wasm` or `native`.
    pub mode: &'a str,
    pub keep_order: bool,
    pub elapsed_s: f64,
    /// Where the published figures came from, when there are any.
    pub published_from: Option<&'a Path>,
}

/// Escapes text for HTML element content and attribute values (policy
/// names come from untrusted components, file names from the user).
pub fn escape_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// The curves as an SVG document: per policy the mean unallocated % against
/// arrival %, a band from the min to the max over the seeds, and the
/// published means (hollow circles) where known.
pub fn curves_svg(title: &str, rows: &[ResultRow], policies: &[String], published: &Published) -> anyhow::Result<String> {
    use plotters::prelude::*;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let y_top = rows.iter().map(|r| r.unallocated_pct_max).chain(published.values().copied()).fold(1.0, f64::max).min(100.0);
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(56)
            .build_cartesian_2d(0f64..MAX_ARRIVAL_PCT as f64, 0f64..y_top * 1.05)?;
        chart
            .configure_mesh()
            .x_desc("arrived GPU demand, % of capacity")
            .y_desc("unallocated GPU %")
            .light_line_style(RGBColor(235, 235, 235))
            .draw()?;
        for (i, policy) in policies.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let mine: Vec<&ResultRow> = rows.iter().filter(|r| &r.policy == policy).collect();
            // The band: along the max, back along the min.
            let band: Vec<(f64, f64)> = mine
                .iter()
                .map(|r| (r.arrived_pct as f64, r.unallocated_pct_max))
                .chain(mine.iter().rev().map(|r| (r.arrived_pct as f64, r.unallocated_pct_min)))
                .collect();
            if band.len() >= 3 {
                chart.draw_series(std::iter::once(Polygon::new(band, color.mix(0.18).filled())))?;
            }
            chart
                .draw_series(LineSeries::new(mine.iter().map(|r| (r.arrived_pct as f64, r.unallocated_pct_mean)), color.stroke_width(2)))?
                .label(policy.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            let marks: Vec<(f64, f64)> =
                TABLE_POINTS.iter().filter_map(|&p| published.get(&(policy.clone(), p)).map(|&m| (p as f64, m))).collect();
            chart.draw_series(marks.into_iter().map(|(x, y)| Circle::new((x, y), 5, color.stroke_width(2))))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.85))
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

/// The whole report as one HTML page with no external resources.
pub fn html(meta: &HtmlMeta, outcome: &ReplayOutcome, published: &Published) -> anyhow::Result<String> {
    use std::fmt::Write;
    let e = escape_html;
    let title = format!("Unallocated GPUs: {}", meta.source);
    let svg = curves_svg(&title, &outcome.rows, &outcome.policies, published)?;
    let mut h = String::new();
    let seeds = match meta.seeds {
        [only] => format!("seed {only}"),
        [first, .., last] if meta.seeds.windows(2).all(|w| w[1] == w[0] + 1) => format!("seeds {first}-{last}"),
        all => format!("seeds {}", all.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")),
    };
    write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>Berth replay: {}</title>\n<style>{}</style>\n</head>\n<body>\n",
        e(meta.source),
        STYLE
    )?;
    writeln!(h, "<h1>Berth replay: {}</h1>", e(meta.source))?;
    writeln!(
        h,
        "<p class=\"meta\">{} policies &times; {} ({} runs), {} policies, {}, {:.1} s. Protocol of the FGD paper: pods placed one at a time, no departures, unallocated GPU % sampled at each 1% of arrived GPU demand.</p>",
        outcome.policies.len(),
        e(&seeds),
        outcome.runs.len(),
        e(meta.mode),
        if meta.keep_order { "pod list replayed as given (--keep-order)" } else { "pod list shuffled and tuned per seed" },
        meta.elapsed_s
    )?;
    writeln!(h, "<figure id=\"curves\">\n{svg}\n<figcaption>Mean over the seeds (line), min to max over the seeds (band){}.</figcaption>\n</figure>",
        if published.is_empty() { "" } else { ", published mean (circle)" })?;

    writeln!(h, "<h2>Unallocated GPU % at the table points</h2>")?;
    writeln!(h, "<p>Mean over the seeds with [min, max]{}.</p>", match meta.published_from {
        Some(p) => format!("; beneath it the published mean and Berth's difference from it (published figures: <code>{}</code>)", e(&p.display().to_string())),
        None => String::new(),
    })?;
    writeln!(h, "<table id=\"summary\">\n<thead><tr><th>policy</th><th></th>")?;
    for p in TABLE_POINTS {
        write!(h, "<th>arrived {p}%</th>")?;
    }
    writeln!(h, "</tr></thead>\n<tbody>")?;
    for (i, policy) in outcome.policies.iter().enumerate() {
        let has_published = published.keys().any(|(n, _)| n == policy);
        let span = if has_published { 3 } else { 1 };
        let swatch = {
            use plotters::style::{Color, Palette};
            let (r, g, b) = plotters::style::Palette99::pick(i).to_rgba().rgb();
            format!("<span class=\"swatch\" style=\"background:rgb({r},{g},{b})\"></span>")
        };
        write!(h, "<tr class=\"berth\"><th rowspan=\"{span}\" scope=\"rowgroup\">{swatch}{}</th><td>Berth</td>", e(policy))?;
        for p in TABLE_POINTS {
            match outcome.rows.iter().find(|r| &r.policy == policy && r.arrived_pct == p) {
                Some(r) => write!(h, "<td>{:.2} <small>[{:.2}, {:.2}]</small></td>", r.unallocated_pct_mean, r.unallocated_pct_min, r.unallocated_pct_max)?,
                None => write!(h, "<td>-</td>")?,
            }
        }
        writeln!(h, "</tr>")?;
        if has_published {
            write!(h, "<tr class=\"published\"><td>published</td>")?;
            for p in TABLE_POINTS {
                match published.get(&(policy.clone(), p)) {
                    Some(m) => write!(h, "<td>{m:.2}</td>")?,
                    None => write!(h, "<td>-</td>")?,
                }
            }
            write!(h, "</tr>\n<tr class=\"diff\"><td>difference</td>")?;
            for p in TABLE_POINTS {
                let ours = outcome.rows.iter().find(|r| &r.policy == policy && r.arrived_pct == p);
                match (ours, published.get(&(policy.clone(), p))) {
                    (Some(r), Some(m)) => write!(h, "<td>{:+.2}</td>", r.unallocated_pct_mean - m)?,
                    _ => write!(h, "<td>-</td>")?,
                }
            }
            writeln!(h, "</tr>")?;
        }
    }
    writeln!(h, "</tbody>\n</table>")?;

    writeln!(h, "<h2>Runs</h2>\n<table id=\"runs\">\n<thead><tr><th>policy</th><th>seed</th><th>pods offered</th><th>pods placed</th><th>unallocated % at the end</th></tr></thead>\n<tbody>")?;
    for r in &outcome.runs {
        writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.2}</td></tr>",
            e(&r.policy),
            r.seed,
            r.pods_offered,
            r.pods_placed,
            r.final_unallocated_pct
        )?;
    }
    writeln!(h, "</tbody>\n</table>")?;
    writeln!(h, "<footer>Written by berth {}.</footer>\n</body>\n</html>", env!("CARGO_PKG_VERSION"))?;
    Ok(h)
}

/// Writes the HTML report (see [`html`]).
pub fn write_html(path: &Path, meta: &HtmlMeta, outcome: &ReplayOutcome, published: &Published) -> anyhow::Result<()> {
    let page = html(meta, outcome, published)?;
    std::fs::write(path, page).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))
}

pub(crate) const STYLE: &str = "body{font-family:sans-serif;margin:2em auto;max-width:1000px;color:#222;padding:0 1em}\
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em}\
.meta{color:#555}figure{margin:1em 0}figure svg{max-width:100%;height:auto}figcaption{color:#555;font-size:.9em}\
table{border-collapse:collapse;font-size:.9em}th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right}\
th[scope]{text-align:left}thead th{background:#f3f3f3}tr.published td{color:#555}tr.diff td{color:#777;font-style:italic}\
small{color:#777}.swatch{display:inline-block;width:.8em;height:.8em;margin-right:.4em;border-radius:2px}\
footer{margin-top:2em;color:#888;font-size:.8em}";
