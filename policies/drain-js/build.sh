#!/usr/bin/env bash
# Builds drain-js.wasm into $1 (default: .) with componentize-js, run from
# the folder holding the WIT. Every WASI feature is disabled, so the
# component imports only Berth's host interface.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(cd "${1:-.}" && pwd)"
cd "$here/../../wit/v0.3.0"
componentize-js "$here/drain.js" --wit . -n placement-policy -d stdio random clocks http fetch-event -o "$out/drain-js.wasm" >/dev/null
