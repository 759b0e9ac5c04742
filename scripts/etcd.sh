#!/usr/bin/env bash
# Starts a single-member etcd for demos: scripts/etcd.sh DATA_DIR [CLIENT_PORT]
# (default 2379; the peer port is CLIENT_PORT+1). Runs in the foreground;
# stop it with Ctrl-C. Installs etcd first when it is missing.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ $# -ge 1 ] || { echo "usage: scripts/etcd.sh DATA_DIR [CLIENT_PORT]" >&2; exit 2; }
bash "$root/scripts/install-etcd.sh"
dir="$1"; port="${2:-2379}"; peer=$((port + 1))
mkdir -p "$dir"
exec etcd --name berth --data-dir "$dir" \
    --listen-client-urls "http://127.0.0.1:$port" --advertise-client-urls "http://127.0.0.1:$port" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "berth=http://127.0.0.1:$peer"
