#!/usr/bin/env bash
# Builds every policy (policies/*) and hostile test guest (tests/guests/*) to a
# wasm component, offline:
#   target/policies/<name>.wasm     bundled policies
#   target/test-guests/<name>.wasm  hostile guests for the tests
# Uses a rustup wasm32-unknown-unknown target where one is installed;
# otherwise Debian's rustc-web/cargo-web/rust-web-src + lld (installed here if
# missing) with build-std. Idempotent: reruns take seconds.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
target_dir="$root/target/guest"
wasm_dir="$target_dir/wasm32-unknown-unknown/release"

if command -v rustup >/dev/null && rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown; then
    guest_cargo=(cargo build --release --target wasm32-unknown-unknown)
    guest_env=()
    echo "build-policies: using the rustup wasm32-unknown-unknown target"
else
    bash "$root/scripts/install-guest-toolchain.sh"
    guest_cargo=(/usr/bin/cargo build --release --target wasm32-unknown-unknown -Z build-std=std,panic_abort)
    guest_env=(RUSTC=/usr/bin/rustc RUSTC_BOOTSTRAP=1 CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_LINKER=wasm-ld)
    echo "build-policies: using Debian's rustc-web with build-std"
fi

# The host binary wraps modules into components (wit-component).
cargo build --release -p berth --bin berth
berth="$root/target/release/berth"

for ws in policies tests/guests; do
    (cd "$root/$ws" && env "${guest_env[@]}" "${guest_cargo[@]}" --target-dir "$target_dir")
done

mkdir -p target/policies target/test-guests
for module in "$wasm_dir"/berth_policy_*.wasm; do
    name="$(basename "$module" .wasm)"; name="${name#berth_policy_}"; name="${name//_/-}"
    "$berth" policy componentize "$module" -o "target/policies/$name.wasm"
done
for module in "$wasm_dir"/berth_guest_*.wasm; do
    name="$(basename "$module" .wasm)"; name="${name#berth_guest_}"; name="${name//_/-}"
    "$berth" policy componentize "$module" -o "target/test-guests/$name.wasm"
done
echo "build-policies: $(ls target/policies | wc -l) policies in target/policies, $(ls target/test-guests | wc -l) test guests in target/test-guests"
