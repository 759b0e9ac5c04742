#!/usr/bin/env bash
# The test command: installs the guest toolchain if needed, builds every policy
# and test guest to a component, then runs the whole test suite (release: the
# wasm and replay tests are slow unoptimised).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build-policies.sh
# etcd for the high-availability tests (they start their own instance).
bash scripts/install-etcd.sh
BERTH_REQUIRE_TRACES="${BERTH_REQUIRE_TRACES:-${CI:+1}}" cargo test --release --workspace "$@"
