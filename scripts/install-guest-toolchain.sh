#!/usr/bin/env bash
# Installs the offline wasm guest toolchain from Debian's packages when it is
# missing: rustc-web, cargo-web and rust-web-src (a std to build for wasm32)
# and lld (wasm-ld). Idempotent.
set -euo pipefail
need=()
for pkg in rustc-web cargo-web rust-web-src lld; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "install-guest-toolchain: missing ${need[*]}; run as root, or install a rustup wasm32-unknown-unknown target" >&2
        exit 1
    fi
    echo "install-guest-toolchain: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v wasm-ld >/dev/null || { echo "install-guest-toolchain: wasm-ld not found after installing lld" >&2; exit 1; }
