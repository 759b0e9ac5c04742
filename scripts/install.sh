#!/usr/bin/env bash
# Installs berth and its bundled policies under a prefix, so that the
# binary finds them from any folder:
#   PREFIX/bin/berth
#   PREFIX/share/berth/policies/<name>.wasm
# Usage: scripts/install.sh [--rust-only] [PREFIX]   (default PREFIX: ~/.local)
#   --rust-only   install the Rust policies only (no Python, JS or C
#                 toolchains; the *-py, *-js and *-c policies are left out)
# Builds what is missing first (scripts/build-policies.sh); `berth policy
# list` then names the folder it uses and why.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build=()
prefix="$HOME/.local"
for arg in "$@"; do
    case "$arg" in
        --rust-only) build+=(--rust-only) ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        -*) echo "install: unknown option $arg (see --help)" >&2; exit 2 ;;
        *) prefix="$arg" ;;
    esac
done
bash "$root/scripts/build-policies.sh" "${build[@]}"
install -d "$prefix/bin" "$prefix/share/berth/policies"
install -m 755 "$root/target/release/berth" "$prefix/bin/berth"
install -m 644 "$root"/target/policies/*.wasm "$prefix/share/berth/policies/"
echo "install: $prefix/bin/berth with $(ls "$prefix/share/berth/policies" | wc -l) policies in $prefix/share/berth/policies"
"$prefix/bin/berth" policy list | head -1
