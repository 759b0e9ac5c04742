#!/usr/bin/env bash
# Installs the toolchains of the non-Rust policies (policies/best-fit-{py,js,c})
# from package registries, pinned, each skipped when the pinned version is
# already there. Idempotent; prints what it installs.
#   Python: componentize-py   (PyPI, in a venv under $BERTH_TOOLS)
#   JS:     componentize-js   (npm, under $BERTH_TOOLS/npm; node from apt if missing)
#   C:      clang, lld, wasi-libc, wasm32 compiler-rt (apt) + wit-bindgen-cli (cargo install)
# Then `source scripts/lang-env.sh` puts them on PATH.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/scripts/lang-env.sh"

COMPONENTIZE_PY=0.25.1
COMPONENTIZE_JS=0.23.0
WIT_BINDGEN=0.53.0

apt_need=()
for pkg in clang lld wasi-libc libclang-rt-dev-wasm32; do
    dpkg -s "$pkg" >/dev/null 2>&1 || apt_need+=("$pkg")
done
command -v node >/dev/null && command -v npm >/dev/null || apt_need+=(nodejs npm)
python3 -c 'import venv, ensurepip' 2>/dev/null || apt_need+=(python3-venv)
if [ ${#apt_need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "install-lang-toolchains: missing ${apt_need[*]}; run as root" >&2
        exit 1
    fi
    echo "install-lang-toolchains: apt-get install ${apt_need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_need[@]}" >/dev/null
fi

mkdir -p "$BERTH_TOOLS"
if [ "$(componentize-py --version 2>/dev/null | awk '{print $2}')" != "$COMPONENTIZE_PY" ]; then
    echo "install-lang-toolchains: componentize-py $COMPONENTIZE_PY"
    [ -x "$BERTH_TOOLS/py/bin/pip" ] || python3 -m venv "$BERTH_TOOLS/py"
    "$BERTH_TOOLS/py/bin/pip" install -q --disable-pip-version-check "componentize-py==$COMPONENTIZE_PY"
fi
if [ "$(componentize-js --version 2>/dev/null)" != "$COMPONENTIZE_JS" ]; then
    echo "install-lang-toolchains: componentize-js $COMPONENTIZE_JS"
    npm install -g -s --no-fund --no-audit --prefix "$BERTH_TOOLS/npm" "@bytecodealliance/componentize-js@$COMPONENTIZE_JS" >/dev/null
fi
if [ "$(wit-bindgen --version 2>/dev/null | awk '{print $2}')" != "$WIT_BINDGEN" ]; then
    echo "install-lang-toolchains: wit-bindgen-cli $WIT_BINDGEN (cargo install, a few minutes once)"
    cargo install -q --locked --root "$BERTH_TOOLS/cargo" "wit-bindgen-cli@$WIT_BINDGEN"
fi
for tool in componentize-py componentize-js wit-bindgen clang wasm-ld; do
    command -v "$tool" >/dev/null || { echo "install-lang-toolchains: $tool not found after installing" >&2; exit 1; }
done
