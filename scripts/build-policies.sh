#!/usr/bin/env bash
# Builds every policy (policies/*, Rust, and best-fit in Python, JS and C) and
# hostile test guest (tests/guests/*) to a wasm component, offline:
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
# best-fit in Python, JavaScript and C: toolchains from package registries,
# pinned (install-lang-toolchains.sh). A component is rebuilt only when its
# sources, the WIT or the toolchain changed (componentize-py and -js take
# tens of seconds).
bash "$root/scripts/install-lang-toolchains.sh"
source "$root/scripts/lang-env.sh"
stamp_of() {
    local dir="$1" tool="$2"
    { find "$root/policies/$dir" -type f ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum
      sha256sum "$root/wit/v0.2.0/policy.wit"; "$tool" --version; } | sha256sum | cut -d' ' -f1
}
for lang in py:componentize-py js:componentize-js c:wit-bindgen; do
    dir="best-fit-${lang%%:*}"
    stamp="$(stamp_of "$dir" "${lang#*:}")"
    if [ -f "target/policies/$dir.wasm" ] && [ "$(cat "target/policies/.$dir.stamp" 2>/dev/null)" = "$stamp" ]; then
        continue
    fi
    echo "build-policies: building $dir"
    BERTH="$berth" bash "$root/policies/$dir/build.sh" "$root/target/policies"
    echo "$stamp" > "target/policies/.$dir.stamp"
done
echo "build-policies: $(ls target/policies | wc -l) policies in target/policies, $(ls target/test-guests | wc -l) test guests in target/test-guests"
