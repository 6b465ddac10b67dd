#!/usr/bin/env bash
# The main job on one machine: installs what is missing (Python packages, Debian's
# NGINX with its Lua module), then runs `dscache demo` (extra arguments go to it,
# e.g. --quick, --json out.json, --png out.png).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh nginx-light libnginx-mod-http-ndk libnginx-mod-http-lua
exec .venv/bin/dscache demo "$@"
