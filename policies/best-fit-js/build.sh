#!/usr/bin/env bash
# Builds best-fit-js.wasm into $1 (default: .) with componentize-js, run from
# the folder holding the WIT. Every WASI feature is disabled, so the
# component imports only Berth's host interface.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(cd "${1:-.}" && pwd)"
cd "$here/../../wit/v0.2.0"
componentize-js "$here/best-fit.js" --wit . -n placement-policy -d stdio random clocks http fetch-event -o "$out/best-fit-js.wasm" >/dev/null
