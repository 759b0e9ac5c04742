#!/usr/bin/env bash
# Builds {{name}}.wasm: C bindings with `wit-bindgen c` (cargo install
# wit-bindgen-cli@0.53.0), clang for wasm32-wasi against Debian's wasi-libc
# (apt install clang lld wasi-libc libclang-rt-dev-wasm32) as a reactor, then
# `berth policy componentize`. Use only malloc/free and libm: stdio would
# import WASI, which the host does not provide.
set -euo pipefail
cd "$(dirname "$0")"
berth="${BERTH:-$(command -v berth || echo "{{berth}}")}"
mkdir -p gen
wit-bindgen c wit --world placement-policy --out-dir gen >/dev/null
clang --target=wasm32-wasi -O2 -mexec-model=reactor -Wall -Werror -Wno-unused-function -I gen \
    policy.c gen/placement_policy.c gen/placement_policy_component_type.o -o gen/module.wasm
"$berth" policy componentize gen/module.wasm -o {{name}}.wasm
echo "built {{name}}.wasm"
