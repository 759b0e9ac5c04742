#!/usr/bin/env bash
# Builds {{name}}.wasm: the crate for wasm32 (a rustup target where one is
# installed, else Debian's rustc-web with build-std), then a component.
set -euo pipefail
cd "$(dirname "$0")"
berth="${BERTH:-$(command -v berth || echo "{{berth}}")}"
if command -v rustup >/dev/null && rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown; then
    cargo build --release --target wasm32-unknown-unknown
else
    RUSTC=/usr/bin/rustc RUSTC_BOOTSTRAP=1 CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_LINKER=wasm-ld \
        /usr/bin/cargo build --release --target wasm32-unknown-unknown -Z build-std=std,panic_abort
fi
"$berth" policy componentize "${CARGO_TARGET_DIR:-target}/wasm32-unknown-unknown/release/{{crate_file}}.wasm" -o {{name}}.wasm
echo "built {{name}}.wasm"
