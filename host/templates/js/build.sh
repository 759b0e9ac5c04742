#!/usr/bin/env bash
# Builds {{name}}.wasm with componentize-js (npm install -g
# @bytecodealliance/componentize-js@0.23.0). Every WASI feature is disabled,
# so the component imports only Berth's host interface.
set -euo pipefail
cd "$(dirname "$0")/wit"
componentize-js ../policy.js --wit . -n placement-policy -d stdio random clocks http fetch-event -o ../{{name}}.wasm
echo "built {{name}}.wasm"
