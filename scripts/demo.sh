#!/usr/bin/env bash
# The demo: builds the host and every Rust policy (installing the Rust wasm
# guest toolchain if needed; not the Python, JS or C ones, which
# scripts/test.sh builds: the README's tour uses more than the six replayed
# here, binpack first), then replays a seeded, generated GPU-cluster trace
# with the six FGD-paper policies as wasm components, under the FGD paper's
# protocol. Writes target/demo/replay.{json,svg}. Extra arguments go to
# `berth replay` (e.g. --nodes/--pods to replay your own openb trace).
set -euo pipefail
cd "$(dirname "$0")/.."
policies=(random dotprod gpu-clustering gpu-packing best-fit fgd)
bash scripts/build-policies.sh --rust-only
mkdir -p target/demo
target/release/berth replay \
    "${policies[@]/#/--policy=}" \
    --seeds 42-46 --json target/demo/replay.json --svg target/demo/replay.svg "$@"
echo "wrote target/demo/replay.json and target/demo/replay.svg"
