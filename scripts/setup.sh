#!/usr/bin/env bash
# Installs everything dscache needs, from nothing, on a fresh Debian machine.
# Idempotent: a second run only checks. Used by the README's commands and by CI.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# uv installs the pinned dependencies: it links them from its cache
# (~/.cache/uv) instead of copying, so a second clone's .venv costs seconds and
# almost no disk (torch and its CUDA libraries are about 6 GB); setup-vllm.sh
# uses the same uv.
UV_VERSION=0.13.9
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { printf '[setup] %s\n' "$*"; }

# System packages the end-to-end paths use (only when missing; needs root or sudo).
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
install_debs setup "$@"

if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.dscache-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ tools/pyproject.toml -nt "$stamp" ]; then
  log "installing dscache and its pinned dependencies into .venv (torch is large: minutes the first time)"
  .venv/bin/pip install -q --upgrade pip==26.3 "uv==${UV_VERSION}"
  # The runtime (dscache) and the tooling (dscache-tools: benches, demo, dev cluster).
  .venv/bin/uv pip install -q --python .venv/bin/python -e '.[all]' -e ./tools
  touch "$stamp"
fi
log "ready: $(.venv/bin/dscache --version)"
