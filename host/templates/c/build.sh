#!/usr/bin/env bash
# Builds {{name}}.wasm: C bindings with `wit-bindgen c` {{wit_bindgen}}, clang for
# wasm32-wasi against Debian's wasi-libc as a reactor, then
# `berth policy componentize`. Use only malloc/free and libm: stdio would
# import WASI, which the host does not provide. Finds wit-bindgen on PATH or
# where Berth's toolchain installer puts it ($BERTH_TOOLS, default
# ~/.cache/berth-tools), so it builds from any folder.
set -euo pipefail
cd "$(dirname "$0")"
# Recorded by `berth policy new`: what installs the toolchain, and the berth
# binary that created this project.
installer={{installer_sh}}
created_by={{berth_sh}}
tools="${BERTH_TOOLS:-${HOME:-/root}/.cache/berth-tools}"
PATH="$PATH:$tools/cargo/bin"
missing() {
    echo "build.sh: $1 not found. Install it with" >&2
    echo "  $installer" >&2
    echo "or: $2" >&2
    exit 1
}
command -v wit-bindgen >/dev/null || missing "wit-bindgen (looked on PATH and in $tools/cargo/bin)" "cargo install --locked wit-bindgen-cli@{{wit_bindgen}}"
command -v clang >/dev/null || missing clang "apt-get install clang lld wasi-libc libclang-rt-dev-wasm32"
command -v wasm-ld >/dev/null || missing "wasm-ld (clang's wasm linker)" "apt-get install lld"
[ -f "$(clang --target=wasm32-wasi -print-file-name=libc.a)" ] ||
    missing "wasi-libc (libc.a for wasm32-wasi)" "apt-get install wasi-libc libclang-rt-dev-wasm32"
berth="${BERTH:-$created_by}"
[ -x "$berth" ] || berth="$(command -v berth)" || missing "berth (the binary that created this project, $created_by, is gone)" "cargo build --release -p berth in the Berth repository, then put target/release on PATH or set BERTH"
mkdir -p gen
wit-bindgen c wit --world placement-policy --out-dir gen >/dev/null
# The hooks policy.c implements: their stubs in unclaimed.c are left out.
claims=({{claims}})
clang --target=wasm32-wasi -O2 -mexec-model=reactor -Wall -Werror -Wno-unused-function -I gen "${claims[@]}" \
    policy.c unclaimed.c gen/placement_policy.c gen/placement_policy_component_type.o -o gen/module.wasm
"$berth" policy componentize gen/module.wasm -o {{name}}.wasm
echo "built {{name}}.wasm"
