#!/usr/bin/env bash
# Builds (or reuses) the dev Kubernetes cluster's binaries: kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, etcd, kwok and helm, from Go
# modules at the versions pinned in tools/dscache_tools/devcluster/versions.py, into
# ${XDG_CACHE_HOME:-~/.cache}/dscache/. Idempotent: a second run takes seconds.
#
# Needs only Go (>= 1.26) and a Python 3.11 interpreter; no Python packages, so
# CI can start it in the background before installing the project:
#     bash scripts/build-dev-cluster.sh > build-dev-cluster.log 2>&1 &
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! command -v go >/dev/null 2>&1 && [ -x /usr/local/go/bin/go ]; then
    export PATH="$PATH:/usr/local/go/bin"
fi
if ! command -v go >/dev/null 2>&1; then
    echo "error: the Go toolchain (>= 1.26) is needed to build the dev cluster" >&2
    exit 1
fi
# nice comes with coreutils; install it on a stripped-down machine.
if ! command -v nice >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq coreutils
fi

# shellcheck source=scripts/lib.sh
source "$repo/scripts/lib.sh"
python="$(repo_python "$repo")"

echo "[dev cluster build] $(go version); python $("$python" -c 'import sys; print(sys.version.split()[0])')"
cd "$repo"
PYTHONPATH="$repo/tools:$repo${PYTHONPATH:+:$PYTHONPATH}" exec nice -n 19 "$python" -m dscache_tools.devcluster "$@"
