# Sourced: puts the toolchains install-lang-toolchains.sh installs on PATH.
# $BERTH_TOOLS (default ~/.cache/berth-tools) outlives clean clones, so a
# machine installs each toolchain once.
export BERTH_TOOLS="${BERTH_TOOLS:-${HOME:-/root}/.cache/berth-tools}"
export PATH="$BERTH_TOOLS/py/bin:$BERTH_TOOLS/npm/bin:$BERTH_TOOLS/cargo/bin:$PATH"
