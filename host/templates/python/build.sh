#!/usr/bin/env bash
# Builds {{name}}.wasm with componentize-py (pip install componentize-py==0.25.1);
# WASI is stubbed out, so the component imports only Berth's host interface.
set -euo pipefail
cd "$(dirname "$0")"
componentize-py -d wit -w placement-policy componentize app -o {{name}}.wasm --stub-wasi
echo "built {{name}}.wasm"
