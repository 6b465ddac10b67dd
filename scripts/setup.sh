#!/usr/bin/env bash
# Installs everything dscache needs, from nothing, on a fresh Debian machine.
# Idempotent: a second run only checks. Used by the README's commands and by CI.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { printf '[setup] %s\n' "$*"; }

# System packages the end-to-end paths use (only when missing; needs root or sudo).
need_pkgs=()
for pkg in "$@"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_pkgs+=("$pkg")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  log "installing Debian packages: ${need_pkgs[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.dscache-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  log "installing dscache and its pinned dependencies into .venv (torch is large: minutes the first time)"
  .venv/bin/pip install -q --upgrade pip==26.3
  .venv/bin/pip install -q -e '.[all]'
  touch "$stamp"
fi
log "ready: $(.venv/bin/dscache --version)"
