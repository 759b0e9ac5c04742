#!/usr/bin/env bash
# Builds every policy (policies/*: Rust, and best-fit, spot-gpu, drain and pool-demand in Python, JS and C) and
# hostile test guest (tests/guests/*) to a wasm component, offline:
#   target/policies/<name>.wasm     bundled policies
#   target/test-guests/<name>.wasm  hostile guests for the tests
# Options (scripts/test.sh passes none: it needs everything):
#   --rust-only   skip the Python, JS and C policies and their toolchains
#   NAME...       build only these bundled policies (no test guests); the
#                 Python/JS/C toolchains are installed only if one is named
#                 (scripts/demo.sh names the Rust policies it replays)
# Uses a rustup wasm32-unknown-unknown target where one is installed;
# otherwise Debian's rustc-web/cargo-web/rust-web-src + lld (installed here if
# missing) with build-std. Idempotent: reruns take seconds.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
rust_only=0
only=()
for arg in "$@"; do
    case "$arg" in
        --rust-only) rust_only=1 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        -*) echo "build-policies: unknown option $arg (see --help)" >&2; exit 2 ;;
        *) [ -d "policies/$arg" ] || { echo "build-policies: no policy policies/$arg" >&2; exit 2; }
           only+=("$arg") ;;
    esac
done
# The Rust crates and the other-language policies to build.
rust_pkgs=()
langs=(best-fit-py best-fit-js best-fit-c spot-gpu-py drain-js pool-demand-c)
if [ ${#only[@]} -gt 0 ]; then
    langs=()
    for name in "${only[@]}"; do
        if [ -f "policies/$name/Cargo.toml" ]; then rust_pkgs+=(-p "berth-policy-$name"); else langs+=("$name"); fi
    done
fi
[ "$rust_only" = 1 ] && langs=()
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

mkdir -p target/policies target/test-guests
if [ ${#only[@]} -gt 0 ]; then
    if [ ${#rust_pkgs[@]} -gt 0 ]; then
        (cd "$root/policies" && env "${guest_env[@]}" "${guest_cargo[@]}" --target-dir "$target_dir" "${rust_pkgs[@]}")
    fi
    for name in "${only[@]}"; do
        [ -f "policies/$name/Cargo.toml" ] || continue
        "$berth" policy componentize "$wasm_dir/berth_policy_${name//-/_}.wasm" -o "target/policies/$name.wasm"
    done
else
    for ws in policies tests/guests; do
        (cd "$root/$ws" && env "${guest_env[@]}" "${guest_cargo[@]}" --target-dir "$target_dir")
    done
    for module in "$wasm_dir"/berth_policy_*.wasm; do
        name="$(basename "$module" .wasm)"; name="${name#berth_policy_}"; name="${name//_/-}"
        "$berth" policy componentize "$module" -o "target/policies/$name.wasm"
    done
    for module in "$wasm_dir"/berth_guest_*.wasm; do
        name="$(basename "$module" .wasm)"; name="${name#berth_guest_}"; name="${name//_/-}"
        "$berth" policy componentize "$module" -o "target/test-guests/$name.wasm"
    done
fi
# best-fit in Python, JavaScript and C: toolchains from package registries,
# pinned (install-lang-toolchains.sh). A component is rebuilt only when its
# sources, the WIT or the toolchain changed (componentize-py and -js take
# tens of seconds).
if [ ${#langs[@]} -eq 0 ]; then
    echo "build-policies: $(ls target/policies | wc -l) policies in target/policies (Python, JS and C skipped)"
    exit 0
fi
bash "$root/scripts/install-lang-toolchains.sh"
source "$root/scripts/lang-env.sh"
stamp_of() {
    local dir="$1" tool="$2"
    { find "$root/policies/$dir" -type f ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum
      sha256sum "$root"/wit/v0.*/policy.wit "$root"/host/templates/c/unclaimed.c; "$tool" --version; } | sha256sum | cut -d' ' -f1
}
for dir in "${langs[@]}"; do
    case "$dir" in
        *-py) tool=componentize-py ;;
        *-js) tool=componentize-js ;;
        *) tool=wit-bindgen ;;
    esac
    stamp="$(stamp_of "$dir" "$tool")"
    if [ -f "target/policies/$dir.wasm" ] && [ "$(cat "target/policies/.$dir.stamp" 2>/dev/null)" = "$stamp" ]; then
        continue
    fi
    echo "build-policies: building $dir"
    BERTH="$berth" bash "$root/policies/$dir/build.sh" "$root/target/policies"
    echo "$stamp" > "target/policies/.$dir.stamp"
done
echo "build-policies: $(ls target/policies | wc -l) policies in target/policies, $(ls target/test-guests | wc -l) test guests in target/test-guests"
