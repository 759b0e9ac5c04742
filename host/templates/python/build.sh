#!/usr/bin/env bash
# Builds {{name}}.wasm with componentize-py {{componentize_py}}; WASI is stubbed
# out, so the component imports only Berth's host interface. Finds
# componentize-py on PATH or where Berth's toolchain installer puts it
# ($BERTH_TOOLS, default ~/.cache/berth-tools), so it builds from any folder.
set -euo pipefail
cd "$(dirname "$0")"
# Recorded by `berth policy new`: what installs the toolchain.
installer={{installer_sh}}
tools="${BERTH_TOOLS:-${HOME:-/root}/.cache/berth-tools}"
PATH="$PATH:$tools/py/bin"
if ! command -v componentize-py >/dev/null; then
    echo "build.sh: componentize-py not found (looked on PATH and in $tools/py/bin). Install it with" >&2
    echo "  $installer" >&2
    echo "or: pip install componentize-py=={{componentize_py}}" >&2
    exit 1
fi
componentize-py -d wit -w placement-policy componentize app -o {{name}}.wasm --stub-wasi
echo "built {{name}}.wasm"
