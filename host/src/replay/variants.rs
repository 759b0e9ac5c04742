//! Openb-like pod lists that no policy was fitted on (`berth trace
//! variant`), built from a published pod list the way the FGD authors built
//! their families from the default trace: each variant changes one property
//! and keeps the rest of the workload's shapes.
//!
//! - `cpu L`: CPU-only pods are L per mille of the pods (cpu050/100/200
//!   are 5/10/20%; the default trace has 13.3%). GPU pods are kept; CPU-only
//!   pods are drawn from the base's, with replacement once they run out.
//! - `gpushare L`: shared-GPU pods (under 1,000 milli of one GPU) ask L% of
//!   the GPU demand, the pod count unchanged: random whole one-GPU pods are
//!   replaced by random shared pods of the base (or the reverse to go down).
//! - `gpuspec L`: L% of the GPU pods are pinned to GPU models drawn from a
//!   mix: `openb` (the published gpuspec traces' mix of constraints), `gpus`
//!   (one model, in proportion to the cluster's GPUs of it) or `v100` (the
//!   older V100 and P100 models). A pin is only drawn where an empty node of
//!   those models could hold the pod.
//! - `multigpu L`: pods of two GPUs or more ask L% of the GPU demand: the
//!   base's multi-GPU pods are drawn again and added (or random ones removed).
//!
//! Seeded (ChaCha8): the same base, variant and seed give the same file.
//! Added copies are named `<name>-v<k>`; creation and deletion times are the
//! copied pod's (the FGD protocol does not read them).

use std::collections::BTreeMap;
use std::io::Write;

use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::openb::{NodeRow, PodRow};

/// Which property a variant changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Family {
    Cpu,
    Gpushare,
    Gpuspec,
    Multigpu,
}

/// Where a `gpuspec` variant's pins come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mix {
    /// The constraints of the published gpuspec traces, in their shares.
    Openb,
    /// One model per pin, in proportion to the cluster's GPUs of it.
    Gpus,
    /// The older V100 and P100 models.
    V100,
}

/// The published gpuspec traces' constraints with their pod counts (the ten
/// commonest of `openb_pod_list_gpuspec25.csv`, 94% of its pinned pods).
const OPENB_PINS: &[(&str, u32)] = &[
    ("T4", 906),
    ("G2", 248),
    ("P100", 215),
    ("V100M16|V100M32", 126),
    ("P100|V100M16|V100M32", 74),
    ("G3", 59),
    ("G2|P100|T4|V100M16|V100M32", 37),
    ("P100|T4|V100M16|V100M32", 22),
    ("A10|G2|T4|V100M16|V100M32", 17),
    ("P100|V100M16", 11),
];

const V100_PINS: &[(&str, u32)] = &[("V100M16|V100M32", 2), ("V100M32", 1), ("P100", 1)];

/// Levels outside these are refused (a share of 0 to 100%).
pub const MAX_LEVEL: [u32; 4] = [900, 95, 100, 95];

/// What a variant is built to: the shares the families are named by.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Shares {
    /// CPU-only pods per pod.
    pub cpu_only_pods: f64,
    /// Milli-GPU of shared-GPU pods per milli-GPU asked.
    pub shared_gpu_demand: f64,
    /// Pinned GPU pods per GPU pod.
    pub pinned_gpu_pods: f64,
    /// Milli-GPU of pods of two GPUs or more per milli-GPU asked.
    pub multi_gpu_demand: f64,
    pub pods: usize,
}

pub fn shares(pods: &[PodRow]) -> Shares {
    let gpu_pods = pods.iter().filter(|p| p.num_gpu > 0).count().max(1) as f64;
    let demand = pods.iter().map(PodRow::total_gpu_milli).sum::<u64>().max(1) as f64;
    Shares {
        cpu_only_pods: pods.iter().filter(|p| p.num_gpu == 0).count() as f64 / pods.len().max(1) as f64,
        shared_gpu_demand: pods.iter().filter(|p| is_shared(p)).map(PodRow::total_gpu_milli).sum::<u64>() as f64 / demand,
        pinned_gpu_pods: pods.iter().filter(|p| p.num_gpu > 0 && !p.gpu_spec.is_empty()).count() as f64 / gpu_pods,
        multi_gpu_demand: pods.iter().filter(|p| p.num_gpu >= 2).map(PodRow::total_gpu_milli).sum::<u64>() as f64 / demand,
        pods: pods.len(),
    }
}

fn is_shared(p: &PodRow) -> bool {
    p.num_gpu == 1 && p.gpu_milli < berth_core::MILLI_PER_GPU
}

fn is_whole_single(p: &PodRow) -> bool {
    p.num_gpu == 1 && p.gpu_milli == berth_core::MILLI_PER_GPU
}

/// A copy of `p` under a name no other pod of the list has.
fn copy(p: &PodRow, k: &mut usize) -> PodRow {
    *k += 1;
    PodRow { name: format!("{}-v{k}", p.name), ..p.clone() }
}

/// The variant `family` at `level` (per mille for `cpu`, percent for the
/// others) of `base`, on the cluster `nodes`.
pub fn generate(base: &[PodRow], nodes: &[NodeRow], family: Family, level: u32, mix: Mix, seed: u64) -> Result<Vec<PodRow>, String> {
    let max = MAX_LEVEL[family as usize];
    if level > max {
        return Err(format!("level {level} of {family:?}: at most {max}"));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut pods = base.to_vec();
    let mut copies = 0;
    let pick = |pods: &[PodRow], f: &dyn Fn(&PodRow) -> bool| -> Vec<usize> { (0..pods.len()).filter(|&i| f(&pods[i])).collect() };
    match family {
        Family::Cpu => {
            let target = f64::from(level) / 1000.0;
            let mut cpu_only: Vec<PodRow> = base.iter().filter(|p| p.num_gpu == 0).cloned().collect();
            if cpu_only.is_empty() {
                return Err("the base has no CPU-only pod to draw from".into());
            }
            cpu_only.shuffle(&mut rng);
            let gpu_pods = base.len() - cpu_only.len();
            let want = ((target * gpu_pods as f64) / (1.0 - target)).round() as usize;
            pods.retain(|p| p.num_gpu > 0);
            for k in 0..want {
                let p = if k < cpu_only.len() { cpu_only[k].clone() } else { copy(cpu_only.choose(&mut rng).expect("not empty"), &mut copies) };
                pods.push(p);
            }
        }
        Family::Gpushare => {
            let target = f64::from(level) / 100.0;
            let shared: Vec<PodRow> = base.iter().filter(|p| is_shared(p)).cloned().collect();
            let whole: Vec<PodRow> = base.iter().filter(|p| is_whole_single(p)).cloned().collect();
            if shared.is_empty() || whole.is_empty() {
                return Err("the base needs shared and whole one-GPU pods to trade".into());
            }
            // The share as `shares` computes it, kept up to date per trade.
            let demand = |ps: &mut dyn Iterator<Item = &PodRow>| ps.map(PodRow::total_gpu_milli).sum::<u64>();
            let (mut shared_milli, mut all_milli) = (demand(&mut pods.iter().filter(|p| is_shared(p))), demand(&mut pods.iter()));
            let share = |s: u64, a: u64| s as f64 / a.max(1) as f64;
            let up = share(shared_milli, all_milli) < target;
            let mut slots = pick(&pods, if up { &is_whole_single } else { &is_shared });
            slots.shuffle(&mut rng);
            for i in slots {
                let now = share(shared_milli, all_milli);
                if (up && now >= target) || (!up && now <= target) {
                    break;
                }
                let from = if up { &shared } else { &whole };
                let (old, new) = (pods[i].total_gpu_milli(), from.choose(&mut rng).expect("not empty").clone());
                all_milli = all_milli - old + new.total_gpu_milli();
                shared_milli = if up { shared_milli + new.total_gpu_milli() } else { shared_milli - old };
                pods[i] = PodRow { name: pods[i].name.clone(), ..new };
            }
        }
        Family::Gpuspec => {
            let target = f64::from(level) / 100.0;
            let mut models: BTreeMap<&str, u64> = BTreeMap::new();
            for n in nodes.iter().filter(|n| n.gpus > 0) {
                *models.entry(n.model.as_str()).or_default() += u64::from(n.gpus);
            }
            let table: Vec<(String, u64)> = match mix {
                Mix::Openb => OPENB_PINS.iter().map(|(s, w)| (s.to_string(), u64::from(*w))).collect(),
                Mix::V100 => V100_PINS.iter().map(|(s, w)| (s.to_string(), u64::from(*w))).collect(),
                Mix::Gpus => models.iter().map(|(m, g)| (m.to_string(), *g)).collect(),
            };
            let fits = |p: &PodRow, spec: &str| {
                let accepted: Vec<&str> = spec.split('|').collect();
                nodes.iter().any(|n| accepted.contains(&n.model.as_str()) && n.gpus >= p.num_gpu && n.cpu_milli >= p.cpu_milli && n.memory_mib >= p.memory_mib)
            };
            let gpu_pods = pods.iter().filter(|p| p.num_gpu > 0).count();
            let mut pinned = pods.iter().filter(|p| p.num_gpu > 0 && !p.gpu_spec.is_empty()).count();
            let want = (target * gpu_pods as f64).round() as usize;
            let mut slots = pick(&pods, &|p| p.num_gpu > 0 && p.gpu_spec.is_empty());
            slots.shuffle(&mut rng);
            for i in slots {
                if pinned >= want {
                    break;
                }
                // A spec an empty node could hold the pod under; a pod no
                // draw fits stays unpinned.
                for _ in 0..16 {
                    let spec = &table.choose_weighted(&mut rng, |(_, w)| *w).map_err(|e| e.to_string())?.0;
                    if fits(&pods[i], spec) {
                        pods[i].gpu_spec = spec.split('|').map(str::to_string).collect();
                        pinned += 1;
                        break;
                    }
                }
            }
            if pinned < want {
                return Err(format!("only {pinned} of the {want} pods asked for could be pinned under the {mix:?} mix"));
            }
        }
        Family::Multigpu => {
            let target = f64::from(level) / 100.0;
            let multi: Vec<PodRow> = base.iter().filter(|p| p.num_gpu >= 2).cloned().collect();
            if multi.is_empty() {
                return Err("the base has no multi-GPU pod to draw from".into());
            }
            // The share as `shares` computes it, kept up to date per pod.
            let mut multi_milli: u64 = pods.iter().filter(|p| p.num_gpu >= 2).map(PodRow::total_gpu_milli).sum();
            let mut all_milli: u64 = pods.iter().map(PodRow::total_gpu_milli).sum();
            let share = |m: u64, a: u64| m as f64 / a.max(1) as f64;
            if share(multi_milli, all_milli) < target {
                while share(multi_milli, all_milli) < target {
                    let p = copy(multi.choose(&mut rng).expect("not empty"), &mut copies);
                    (multi_milli, all_milli) = (multi_milli + p.total_gpu_milli(), all_milli + p.total_gpu_milli());
                    // Spread through the list (the protocol shuffles anyway).
                    let at = rng.random_range(0..=pods.len());
                    pods.insert(at, p);
                }
            } else {
                while share(multi_milli, all_milli) > target {
                    let slots = pick(&pods, &|p| p.num_gpu >= 2);
                    let &i = slots.choose(&mut rng).expect("a multi-GPU pod is left while its share is above the target");
                    let gone = pods.remove(i).total_gpu_milli();
                    (multi_milli, all_milli) = (multi_milli - gone, all_milli - gone);
                }
            }
        }
    }
    Ok(pods)
}

/// Writes `pods` as an openb pod list (all eleven columns; the phase and
/// scheduling time, which no reader uses, left empty).
pub fn write_csv(pods: &[PodRow], out: impl Write) -> csv::Result<()> {
    let mut w = csv::Writer::from_writer(out);
    w.write_record(["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos", "pod_phase", "creation_time", "deletion_time", "scheduled_time"])?;
    let opt = |t: Option<u64>| t.map(|t| t.to_string()).unwrap_or_default();
    for p in pods {
        w.write_record([
            p.name.clone(),
            p.cpu_milli.to_string(),
            p.memory_mib.to_string(),
            p.num_gpu.to_string(),
            p.gpu_milli.to_string(),
            p.gpu_spec.join("|"),
            p.qos.clone(),
            String::new(),
            opt(p.creation_time),
            opt(p.deletion_time),
            String::new(),
        ])?;
    }
    w.flush()?;
    Ok(())
}
