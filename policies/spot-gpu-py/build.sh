#!/usr/bin/env bash
# Builds spot-gpu-py.wasm into $1 (default: .) with componentize-py; WASI is
# stubbed out, so the component imports only Berth's host interface.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(cd "${1:-.}" && pwd)"
cd "$here"
componentize-py -d ../../wit/v0.3.0 -w placement-policy componentize app -o "$out/spot-gpu-py.wasm" --stub-wasi >/dev/null
