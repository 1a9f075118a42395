#!/usr/bin/env bash
# Installs the real servers the tests start (Redis, Prometheus with promtool) from Debian's
# packages, once. Installing them starts no service: the tests start their own on 127.0.0.1.
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install-system-deps: need root to apt-get install ${need[*]}" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${need[@]}"
