#!/usr/bin/env bash
# The demo: builds the host and the bundled policies (installing the guest
# toolchain if needed), then places a seeded, generated workload on a
# generated fleet with each bundled policy, in wasm.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build-policies.sh
exec target/release/berth demo "$@"
