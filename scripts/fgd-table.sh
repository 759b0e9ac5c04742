#!/usr/bin/env bash
# Replays every openb pod list with the six FGD-paper policies and berth-frag
# over seeds 42-51 and writes docs/fgd-table.md: Berth's mean unallocated GPU %
# at 100% arrival beside the published mean, then berth-frag against FGD's
# published means (and, on the curve, against FGD replayed by Berth).
# Usage: scripts/fgd-table.sh [DATA_DIR] [--new-only]
# --new-only replays berth-frag (with fgd beside it, for the curve) and keeps
# the six-policy table of the current docs/fgd-table.md (the six replays take
# far longer).
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-../shared/data/openb}"
new_only="${2:-}"
out="target/fgd-table"
mkdir -p "$out/berth-frag"
policies=(--policy random --policy dotprod --policy gpu-clustering --policy gpu-packing --policy best-fit --policy fgd)
for pods in "$data"/openb_pod_list_*.csv; do
    name="$(basename "$pods" .csv)"
    echo "== $name" >&2
    if [ "$new_only" != "--new-only" ]; then
        target/release/berth replay --nodes "$data/openb_node_list_gpu_node.csv" --pods "$pods" "${policies[@]}" \
            --seeds 42-51 --quiet --json "$out/$name.json" > "$out/$name.txt"
        head -1 "$out/$name.txt" >&2
    fi
    # FGD beside it: the curve table compares at Berth's own sampling too.
    target/release/berth replay --nodes "$data/openb_node_list_gpu_node.csv" --pods "$pods" --policy berth-frag --policy fgd \
        --seeds 42-51 --quiet --json "$out/berth-frag/$name.json" > "$out/berth-frag/$name.txt"
    head -1 "$out/berth-frag/$name.txt" >&2
done
if [ "$new_only" = "--new-only" ]; then
    cp docs/fgd-table.md "$out/previous.md"
    python3 scripts/fgd-table.py "$data/fgd_published_unallocated.csv" "$out" "$out/previous.md" > docs/fgd-table.md
else
    python3 scripts/fgd-table.py "$data/fgd_published_unallocated.csv" "$out" > docs/fgd-table.md
fi
cat docs/fgd-table.md
