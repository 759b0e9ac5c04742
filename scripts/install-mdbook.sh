#!/usr/bin/env bash
# Installs mdbook (crates.io, pinned) under $BERTH_TOOLS/cargo, skipped when the
# pinned version is already there. Idempotent. Only the static build: no
# `mdbook serve`/`watch` (they pull in a web server and file watcher).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/scripts/lang-env.sh"

MDBOOK=0.5.4

if [ "$(mdbook --version 2>/dev/null | awk '{print $2}')" != "v$MDBOOK" ]; then
    echo "install-mdbook: mdbook $MDBOOK (cargo install, a few minutes once)"
    mkdir -p "$BERTH_TOOLS"
    cargo install -q --locked --root "$BERTH_TOOLS/cargo" --no-default-features --features search "mdbook@$MDBOOK"
fi
command -v mdbook >/dev/null || { echo "install-mdbook: mdbook not found after installing" >&2; exit 1; }
