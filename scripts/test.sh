#!/usr/bin/env bash
# The test command: installs what is missing, then lint, types, architecture
# contracts, and the whole pytest suite. Extra arguments go to pytest.
#
# The dev cluster's Kubernetes binaries are built from Go modules (minutes the
# first time, seconds once cached under ~/.cache/dscache): the build starts first,
# in the background, while the Python setup, the linters and every test that
# needs no cluster run; the cluster tests run once it is done.
set -euo pipefail
cd "$(dirname "$0")/.."

build_log=$(mktemp -t dscache-build-dev-cluster.XXXXXX.log)
bash scripts/build-dev-cluster.sh >"$build_log" 2>&1 &
build_pid=$!
trap 'kill "$build_pid" 2>/dev/null || true' EXIT

bash scripts/setup.sh nginx-light libnginx-mod-http-ndk libnginx-mod-http-lua prometheus
source .venv/bin/activate

echo "== gRPC stubs"; bash scripts/check_proto.sh
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy (strict)"; mypy
echo "== import contracts"; lint-imports
echo "== helm chart"; python -m dscache_operator.crd --check

echo "== pytest: everything but the cluster tests"
pytest -q -p no:cacheprovider -m "not cluster" "$@"

echo "== waiting for the dev cluster build"
if ! wait "$build_pid"; then
  cat "$build_log"
  echo "the dev cluster build failed" >&2
  exit 1
fi
trap - EXIT
tail -n 3 "$build_log"

echo "== pytest: the cluster tests (a real control plane on loopback)"
pytest -q -p no:cacheprovider -m cluster "$@"
