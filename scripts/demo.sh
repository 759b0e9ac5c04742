#!/usr/bin/env bash
# The demo: builds the host and the bundled policies (installing the guest
# toolchain if needed), then replays a seeded, generated GPU-cluster trace
# with the six FGD-paper policies as wasm components, under the FGD paper's
# protocol. Writes target/demo/replay.{json,svg}. Extra arguments go to
# `berth replay` (e.g. --nodes/--pods to replay your own openb trace).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build-policies.sh
mkdir -p target/demo
target/release/berth replay \
    --policy random --policy dotprod --policy gpu-clustering --policy gpu-packing --policy best-fit --policy fgd \
    --seeds 42-46 --json target/demo/replay.json --svg target/demo/replay.svg "$@"
echo "wrote target/demo/replay.json and target/demo/replay.svg"
