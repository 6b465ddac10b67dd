#!/usr/bin/env bash
# The Kubernetes story on this machine: installs what is missing (Python packages;
# Debian's containerd, runc, CNI plugins, iptables, Prometheus, and docker.io +
# debootstrap for the images), then runs `dscache demo kubernetes` (extra
# arguments go to it, e.g. --quick --json out.json). Needs root and Go (the dev
# cluster's binaries are built from Go modules the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh containerd runc containernetworking-plugins iptables conntrack iproute2 \
  docker.io debootstrap prometheus
exec .venv/bin/dscache demo kubernetes "$@"
