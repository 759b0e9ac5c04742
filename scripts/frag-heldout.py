#!/usr/bin/env python3
"""Held-out evaluation of berth-frag against FGD (issue 35, docs/src/beyond-fgd.md).

Leave one family out: for each family of the 13 openb pod lists (cpu*, gpushare*,
gpuspec*, multigpu*), berth-frag's weights are chosen from a grid by the mean relative
change against FGD's published figure at 100% arrival on the OTHER families' traces
(seeds 42-45), then that choice is replayed on the held-out family's traces with seeds
42-51, beside FGD replayed by Berth on the same seeds and FGD's published mean. Weights of
a term that is silent on every training trace (scarcity acts only where typical pods are
pinned to a model: the gpuspec family) cannot be fitted there and keep the value 1.

Then the generated variants (`berth trace variant`, seeded; never fitted on): FGD and
berth-frag with its shipped weights, seeds 42-51.

Usage: scripts/frag-heldout.py [DATA_DIR] [--workers N] [--only grid|heldout|variants]
Replays are cached under target/frag-heldout/ (delete a file to run it again); the
tables go to stdout as Markdown.
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BERTH = os.path.join(ROOT, "target", "release", "berth")
OUT = os.path.join(ROOT, "target", "frag-heldout")
FAMILIES = {
    "cpu": ["cpu050", "cpu100", "cpu200", "default"],
    "gpushare": ["gpushare40", "gpushare60", "gpushare80"],
    "gpuspec": ["gpuspec10", "gpuspec20", "gpuspec25"],
    "multigpu": ["multigpu20", "multigpu30", "multigpu40"],
}
# The weights searched (the shipped values are cpu = mem 3, residual 1, scale 1500,
# keep 10, scarce 3).
GRID = {
    "cpu": [1.0, 3.0],
    "residual": [0.3, 1.0, 1.5],
    "scale": [1000.0, 1500.0],
    "keep": [3.0, 10.0],
    "scarce": [1.0, 3.0],
}
# The generated variants: family, level, model mix, seed. The first set (seed 7)
# showed berth-frag above FGD on cpu300 and cpu400, which led to its `cpu_bound`
# rule; the second (seed 8, other levels) was generated after that change, to
# check it on workloads nobody had looked at, and showed it above FGD on
# gpuspec10-v100, which led to `displaced` (berth-frag 0.4.0); the third (seed 9,
# other levels again) was generated after that.
VARIANTS = [
    ("cpu", 150, "openb", 7), ("cpu", 300, "openb", 7), ("cpu", 400, "openb", 7),
    ("gpushare", 30, "openb", 7), ("gpushare", 50, "openb", 7), ("gpushare", 70, "openb", 7),
    ("gpuspec", 15, "openb", 7), ("gpuspec", 30, "openb", 7), ("gpuspec", 20, "gpus", 7), ("gpuspec", 20, "v100", 7),
    ("multigpu", 25, "openb", 7), ("multigpu", 35, "openb", 7), ("multigpu", 50, "openb", 7),
    ("cpu", 250, "openb", 8), ("cpu", 350, "openb", 8), ("cpu", 500, "openb", 8),
    ("gpushare", 35, "openb", 8), ("gpushare", 45, "openb", 8), ("gpushare", 65, "openb", 8),
    ("gpuspec", 35, "openb", 8), ("gpuspec", 25, "gpus", 8), ("gpuspec", 10, "v100", 8),
    ("multigpu", 30, "openb", 8), ("multigpu", 45, "openb", 8), ("multigpu", 60, "openb", 8),
    ("cpu", 200, "openb", 9), ("cpu", 450, "openb", 9), ("cpu", 600, "openb", 9),
    ("gpushare", 40, "openb", 9), ("gpushare", 55, "openb", 9), ("gpushare", 75, "openb", 9),
    ("gpuspec", 25, "openb", 9), ("gpuspec", 5, "v100", 9), ("gpuspec", 15, "v100", 9), ("gpuspec", 30, "gpus", 9),
    ("multigpu", 20, "openb", 9), ("multigpu", 40, "openb", 9), ("multigpu", 55, "openb", 9),
]


def weights_of(cfg):
    w = dict(cfg)
    w["mem"] = w["cpu"]
    return w


def key_of(cfg):
    return "-".join(f"{k}{cfg[k]:g}" for k in sorted(cfg))


def replay(nodes, pods, policy, seeds, out, config=None):
    """Runs one replay (cached); returns {policy: unallocated % at 100%}."""
    if not os.path.exists(out):
        cmd = [BERTH, "replay", "--nodes", nodes, "--pods", pods, "--seeds", seeds, "--quiet", "--json", out + ".tmp", "--workers", "1"]
        for p in policy:
            cmd += ["--policy", p]
        if config is not None:
            cmd += ["--policy-config", json.dumps({"weights": config})]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "RUST_BACKTRACE": "0"})
        os.replace(out + ".tmp", out)
    results = json.load(open(out))["results"]
    return {r["policy"]: r["unallocated_pct_mean"] for r in results if r["arrived_pct"] == 100}


def published(data):
    table = {}
    with open(os.path.join(data, "fgd_published_unallocated.csv")) as f:
        header = f.readline().strip().split(",")
        for line in f:
            row = dict(zip(header, line.strip().split(",")))
            if row["policy"] == "06-FGD" and row["arrived_pct"] == "100":
                table[row["workload"].replace("openb_pod_list_", "")] = float(row["unallocated_pct_mean"])
    return table


def grid_configs(trace):
    keys = [k for k in GRID if not (k == "scarce" and not trace.startswith("gpuspec"))]
    for values in itertools.product(*(GRID[k] for k in keys)):
        cfg = dict(zip(keys, values))
        cfg.setdefault("scarce", 1.0)
        yield cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="?", default=os.path.join(ROOT, "..", "shared", "data", "openb"))
    ap.add_argument("--workers", type=int, default=2, help="replays run at once")
    ap.add_argument("--only", choices=["grid", "heldout", "variants"], help="run one stage")
    args = ap.parse_args()
    nodes = os.path.join(args.data, "openb_node_list_gpu_node.csv")
    pods = lambda t: os.path.join(args.data, f"openb_pod_list_{t}.csv")
    pub = published(args.data)
    traces = [t for fam in FAMILIES.values() for t in fam]
    os.makedirs(os.path.join(OUT, "grid"), exist_ok=True)
    os.makedirs(os.path.join(OUT, "heldout"), exist_ok=True)
    os.makedirs(os.path.join(OUT, "variants"), exist_ok=True)
    pool = ThreadPoolExecutor(args.workers)

    def grid_job(t, cfg):
        return replay(nodes, pods(t), ["berth-frag"], "42-45", os.path.join(OUT, "grid", f"{t}-{key_of(cfg)}.json"), weights_of(cfg))["berth-frag"]

    # 1. The grid on every trace, training seeds.
    jobs = {(t, key_of(c)): pool.submit(grid_job, t, c) for t in traces for c in grid_configs(t)}
    grid = {k: f.result() for k, f in jobs.items()}
    if args.only == "grid":
        return

    def training_score(cfg, held):
        # Mean relative change against FGD published over the training traces; a
        # term silent on them (scarce outside gpuspec) is looked up at 1.
        changes = []
        for fam, ts in FAMILIES.items():
            if fam == held:
                continue
            for t in ts:
                c = dict(cfg) if t.startswith("gpuspec") else {**cfg, "scarce": 1.0}
                changes.append(grid[(t, key_of(c))] / pub[t] - 1)
        return sum(changes) / len(changes)

    # 2. Leave one family out.
    rows = []
    full = [dict(zip(GRID, v)) for v in itertools.product(*GRID.values())]
    for held, ts in FAMILIES.items():
        candidates = [c for c in full if held != "gpuspec" or c["scarce"] == 1.0]
        best = min(candidates, key=lambda c: (training_score(c, held), key_of(c)))
        for t in ts:
            got = replay(nodes, pods(t), ["berth-frag", "fgd"], "42-51", os.path.join(OUT, "heldout", f"{t}-{key_of(best)}.json"), weights_of(best))
            rows.append((held, t, best, got["berth-frag"], got["fgd"], pub[t]))
    print("## Leave one family out (held-out traces, seeds 42-51, unallocated % at 100% arrival)\n")
    print("| held out | trace | weights chosen on the other families | berth-frag | FGD replayed | FGD published | vs replayed | vs published |")
    print("|---|---|---|---|---|---|---|---|")
    for held, t, best, bf, fgd, p in rows:
        w = ", ".join(f"{k} {best[k]:g}" for k in GRID)
        print(f"| {held} | {t} | {w} | {bf:.2f} | {fgd:.2f} | {p:.2f} | {100 * (bf / fgd - 1):+.1f}% | {100 * (bf / p - 1):+.1f}% |")
    n = len(rows)
    print(f"\nMean of {n} held-out traces: berth-frag {sum(r[3] for r in rows) / n:.2f}, FGD replayed {sum(r[4] for r in rows) / n:.2f}, "
          f"FGD published {sum(r[5] for r in rows) / n:.2f}; mean of the per-trace changes {100 * sum(r[3] / r[5] - 1 for r in rows) / n:+.1f}% against published, "
          f"{100 * sum(r[3] / r[4] - 1 for r in rows) / n:+.1f}% against replayed; at or below both on {sum(1 for r in rows if r[3] <= min(r[4], r[5]))} of {n}.\n")
    if args.only == "heldout":
        return

    # 3. Generated variants, shipped weights.
    vrows = []
    for fam, level, mix, seed in VARIANTS:
        name = fam + (f"{level:03d}" if fam == "cpu" else f"{level:02d}") + ("" if mix == "openb" else f"-{mix}") + ("" if seed == 7 else f"-s{seed}")
        path = os.path.join(OUT, "variants", f"{name}.csv")
        if not os.path.exists(path):
            subprocess.run([BERTH, "trace", "variant", "--pods", pods("default"), "--nodes", nodes, "--family", fam, "--level", str(level), "--mix", mix,
                            "--seed", str(seed), "--out", path], check=True)
        vrows.append((name, seed, pool.submit(replay, nodes, path, ["berth-frag", "fgd"], "42-51", os.path.join(OUT, "variants", f"{name}.json"))))
    print("## Generated variants (never fitted on; seeds 42-51, unallocated % at 100% arrival)\n")
    print("| variant | seed | berth-frag | FGD replayed | change |")
    print("|---|---|---|---|---|")
    done = {}
    for name, seed, f in vrows:
        got = f.result()
        done.setdefault(seed, []).append((got["berth-frag"], got["fgd"]))
        print(f"| {name} | {seed} | {got['berth-frag']:.2f} | {got['fgd']:.2f} | {100 * (got['berth-frag'] / got['fgd'] - 1):+.1f}% |")
    for seed, d in sorted(done.items()):
        n = len(d)
        print(f"\nSeed {seed}, {n} variants: berth-frag {sum(x[0] for x in d) / n:.2f}, FGD {sum(x[1] for x in d) / n:.2f}; "
              f"mean of the per-variant changes {100 * sum(x[0] / x[1] - 1 for x in d) / n:+.1f}%; at or below FGD on {sum(1 for x in d if x[0] <= x[1])} of {n}.")


if __name__ == "__main__":
    sys.exit(main())
