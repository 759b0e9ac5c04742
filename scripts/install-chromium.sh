#!/usr/bin/env bash
# Installs Debian's chromium and chromium-driver (apt) for the tests that open
# HTML reports in a real headless browser. Idempotent: skipped when both are
# installed. Needs root the first time.
set -euo pipefail
need=()
for pkg in chromium chromium-driver; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "install-chromium: missing ${need[*]}; run as root" >&2
        exit 1
    fi
    echo "install-chromium: apt-get install ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
for tool in chromium chromedriver; do
    command -v "$tool" >/dev/null || { echo "install-chromium: $tool not found after installing" >&2; exit 1; }
done
