#!/usr/bin/env bash
# The main job on one machine: installs what is missing (Python packages, Debian's
# NGINX with its Lua module), then runs `dscache demo` (extra arguments go to it,
# e.g. --quick, --json out.json, --png out.png).
set -euo pipefail
cd "$(dirname "$0")/.."
# Python keeps the compiled bytecode of what it imports (__pycache__ in the venvs
# and the source tree, both ignored by git) even where the environment says not to
# write it: every model server, sidecar and vLLM engine started imports torch and
# transformers, and compiling them anew costs each start 2-3x the CPU (measured: a
# model server's start 35 -> 12 CPU-s, `import vllm` 45 -> 19).
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh nginx-light libnginx-mod-http-ndk libnginx-mod-http-lua
exec .venv/bin/dscache demo "$@"
