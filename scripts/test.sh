#!/usr/bin/env bash
# The test command: installs the guest toolchain if needed, builds every policy
# and test guest to a component, builds the book, then runs the whole test suite (release: the
# wasm and replay tests are slow unoptimised).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build-policies.sh
# etcd for the high-availability tests (they start their own instance).
bash scripts/install-etcd.sh
# Debian's chromium + chromedriver: the HTML-report test opens its page in a
# real headless browser.
bash scripts/install-chromium.sh
# The book (docs/). mdbook only warns about an include it cannot read, so a
# warning fails the run (tests/integration/docs.rs checks anchors too).
bash scripts/install-mdbook.sh
book_log="$(source scripts/lang-env.sh && mdbook build docs 2>&1)" || { echo "$book_log" >&2; exit 1; }
if grep -E "WARN|ERROR" <<<"$book_log" >&2; then
    echo "test.sh: mdbook build docs warned (above)" >&2
    exit 1
fi
BERTH_REQUIRE_TRACES="${BERTH_REQUIRE_TRACES:-${CI:+1}}" cargo test --release --workspace "$@"
