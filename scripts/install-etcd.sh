#!/usr/bin/env bash
# Installs etcd (Debian's etcd-server) for `berth serve --etcd` and its
# high-availability tests, unless an etcd is already on PATH. Idempotent.
# The tests start their own etcd on a free loopback port with a temporary
# data directory (and stop it); for a long-running one, see
# `scripts/etcd.sh`.
set -euo pipefail
if command -v etcd >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install-etcd: etcd is missing; run as root (apt-get install etcd-server)" >&2
    exit 1
fi
echo "install-etcd: apt-get install etcd-server"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null
# The package may start a system service on the default ports; Berth's
# tests and demos use their own instances, so it is left as the system has it.
etcd --version | head -1
