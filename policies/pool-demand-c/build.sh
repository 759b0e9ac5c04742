#!/usr/bin/env bash
# Builds pool-demand-c.wasm into $1 (default: .): C bindings from the WIT
# with `wit-bindgen c`, clang for wasm32-wasi against Debian's wasi-libc
# (only malloc is used, so the module imports nothing from WASI), the
# unclaimed hooks from the scaffold's unclaimed.c, then
# `berth policy componentize`. Needs $BERTH or berth on PATH.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(cd "${1:-.}" && pwd)"
berth="${BERTH:-$(command -v berth || echo berth)}"
gen="$(mktemp -d)"
trap 'rm -rf "$gen"' EXIT
wit-bindgen c "$here/../../wit/v0.3.0" --world placement-policy --out-dir "$gen" >/dev/null
# A reactor: no main; the host calls the exports.
clang --target=wasm32-wasi -O2 -mexec-model=reactor -Wall -Werror -Wno-unused-function \
    -DBERTH_CLAIMS_POOL_PLACE -DBERTH_CLAIMS_POOL_STEP -I "$gen" \
    "$here/pool_demand.c" "$here/../../host/templates/c/unclaimed.c" "$gen/placement_policy.c" "$gen/placement_policy_component_type.o" \
    -o "$gen/pool_demand_c.module.wasm"
"$berth" policy componentize "$gen/pool_demand_c.module.wasm" -o "$out/pool-demand-c.wasm"
