"""Formats the replay JSONs of scripts/fgd-table.sh beside the published FGD table."""
import csv, json, pathlib, sys

published_csv, out_dir = sys.argv[1], pathlib.Path(sys.argv[2])
names = {"random": "01-Random", "dotprod": "02-DotProd", "gpu-clustering": "03-GpuClustering",
         "gpu-packing": "04-GpuPacking", "best-fit": "05-BestFit", "fgd": "06-FGD"}
published = {}
for row in csv.DictReader(open(published_csv)):
    if row["arrived_pct"] == "100":
        published[(row["workload"], row["policy"])] = float(row["unallocated_pct_mean"])

print("Unallocated GPU % at 100% arrived GPU demand, mean over seeds 42-51: Berth (wasm policies) / published (FGD paper) / difference.\n")
print("| trace | " + " | ".join(names) + " | max abs diff | same order |")
print("|---|" + "---|" * (len(names) + 2))
worst = 0.0
for path in sorted(out_dir.glob("*.json")):
    workload = path.stem
    rows = {r["policy"]: r for r in json.load(open(path))["results"] if r["arrived_pct"] == 100}
    cells, diffs, ours, theirs = [], [], [], []
    for ours_name, paper_name in names.items():
        b = rows[ours_name]["unallocated_pct_mean"]
        p = published[(workload, paper_name)]
        diffs.append(abs(b - p)); ours.append(b); theirs.append(p)
        cells.append(f"{b:.2f} / {p:.2f} / {b - p:+.2f}")
    order = lambda xs: sorted(range(len(xs)), key=lambda i: -xs[i])
    worst = max(worst, max(diffs))
    print(f"| {workload.replace('openb_pod_list_', '')} | " + " | ".join(cells) + f" | {max(diffs):.2f} | {'yes' if order(ours) == order(theirs) else 'no'} |")
print(f"\nLargest difference over all traces and policies: {worst:.2f} percentage points.")
