#!/usr/bin/env bash
# Builds {{name}}.wasm: the crate for wasm32 (a rustup target where one is
# installed, else Debian's rustc-web with build-std), then a component with
# `berth policy componentize`. The berth-sdk dependency is the SDK of the
# Berth checkout that created this project (Cargo.toml), so it builds from
# any folder while that checkout is there.
set -euo pipefail
cd "$(dirname "$0")"
# Recorded by `berth policy new`: what installs the toolchain, and the berth
# binary that created this project.
installer={{installer_sh}}
created_by={{berth_sh}}
missing() {
    echo "build.sh: $1 not found. Install it with" >&2
    echo "  $installer" >&2
    echo "or: $2" >&2
    exit 1
}
berth="${BERTH:-$created_by}"
[ -x "$berth" ] || berth="$(command -v berth)" || missing "berth (the binary that created this project, $created_by, is gone)" "cargo build --release -p berth in the Berth repository, then put target/release on PATH or set BERTH"
if command -v rustup >/dev/null && rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown; then
    cargo build --release --target wasm32-unknown-unknown
else
    [ -x /usr/bin/rustc ] && [ -x /usr/bin/cargo ] && [ -d /usr/lib/rustlib/src/rust/library ] ||
        missing "a Rust wasm32 toolchain (rustup's wasm32-unknown-unknown target, or Debian's rustc-web)" \
            "rustup target add wasm32-unknown-unknown, or apt-get install rustc-web cargo-web rust-web-src lld"
    command -v wasm-ld >/dev/null || missing "wasm-ld" "apt-get install lld"
    RUSTC=/usr/bin/rustc RUSTC_BOOTSTRAP=1 CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_LINKER=wasm-ld \
        /usr/bin/cargo build --release --target wasm32-unknown-unknown -Z build-std=std,panic_abort
fi
"$berth" policy componentize "${CARGO_TARGET_DIR:-target}/wasm32-unknown-unknown/release/{{crate_file}}.wasm" -o {{name}}.wasm
echo "built {{name}}.wasm"
