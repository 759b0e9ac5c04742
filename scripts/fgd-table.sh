#!/usr/bin/env bash
# Replays every openb pod list with the six FGD-paper policies over seeds
# 42-51 and writes docs/fgd-table.md: Berth's mean unallocated GPU % at 100%
# arrival beside the published mean. Usage: scripts/fgd-table.sh [DATA_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-../shared/data/openb}"
out="target/fgd-table"
mkdir -p "$out"
policies=(--policy random --policy dotprod --policy gpu-clustering --policy gpu-packing --policy best-fit --policy fgd)
for pods in "$data"/openb_pod_list_*.csv; do
    name="$(basename "$pods" .csv)"
    echo "== $name" >&2
    target/release/berth replay --nodes "$data/openb_node_list_gpu_node.csv" --pods "$pods" "${policies[@]}" \
        --seeds 42-51 --quiet --json "$out/$name.json" > "$out/$name.txt"
    head -1 "$out/$name.txt" >&2
done
python3 scripts/fgd-table.py "$data/fgd_published_unallocated.csv" "$out" > docs/fgd-table.md
cat docs/fgd-table.md
