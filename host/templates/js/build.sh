#!/usr/bin/env bash
# Builds {{name}}.wasm with componentize-js {{componentize_js}}. Every WASI
# feature is disabled, so the component imports only Berth's host interface.
# Finds componentize-js on PATH or where Berth's toolchain installer puts it
# ($BERTH_TOOLS, default ~/.cache/berth-tools), so it builds from any folder.
set -euo pipefail
cd "$(dirname "$0")"
# Recorded by `berth policy new`: what installs the toolchain.
installer={{installer_sh}}
tools="${BERTH_TOOLS:-${HOME:-/root}/.cache/berth-tools}"
PATH="$PATH:$tools/npm/bin"
if ! command -v componentize-js >/dev/null || ! command -v node >/dev/null; then
    echo "build.sh: componentize-js or node not found (looked on PATH and in $tools/npm/bin). Install them with" >&2
    echo "  $installer" >&2
    echo "or: apt-get install nodejs npm && npm install -g @bytecodealliance/componentize-js@{{componentize_js}}" >&2
    exit 1
fi
cd wit
componentize-js ../policy.js --wit . -n placement-policy -d stdio random clocks http fetch-event -o ../{{name}}.wasm
echo "built {{name}}.wasm"
