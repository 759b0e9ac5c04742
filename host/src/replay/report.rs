//! Aggregating replay curves over seeds, and the outputs: a side-by-side
//! table, JSON, and an SVG plot.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

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

/// Writes `{"results": [...]}`.
pub fn write_json(path: &Path, rows: &[ResultRow]) -> anyhow::Result<()> {
    #[derive(Serialize)]
    struct Doc<'a> {
        results: &'a [ResultRow],
    }
    let text = serde_json::to_string_pretty(&Doc { results: rows })?;
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
