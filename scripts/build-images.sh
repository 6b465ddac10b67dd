#!/usr/bin/env bash
# Builds (or reuses) dscache's container images without any registry:
#   server  ghcr.io/dscache/dscache:<version>         model server + everything in core
#   core    ghcr.io/dscache/dscache-core:<version>    sidecar, operator, prewarm, picker (no torch)
#   router  ghcr.io/dscache/dscache-router:<version>  NGINX with the Lua module
#   pause   dscache.local/pause:1.0                   the dev cluster's pod sandbox
#   vllm    ghcr.io/dscache/dscache-vllm:<version>    vLLM's CPU build with the dscache connector
# from images/Dockerfile, with a private dockerd (stopped afterwards) and a
# debootstrapped Debian base, into ${XDG_CACHE_HOME:-~/.cache}/dscache/images/
# (archives/<name>.tar are `docker save` archives). Idempotent: with unchanged
# inputs a second run starts no Docker at all and takes a second.
#
# Needs root (dockerd, debootstrap) and installs Debian's docker.io and
# debootstrap when missing. Extra arguments go to
# `python -m dscache_tools.devcluster.images` (image names; --force).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# shellcheck source=scripts/lib.sh
source "$repo/scripts/lib.sh"
install_debs images docker.io debootstrap
python="$(repo_python "$repo")"

cd "$repo"
# Standard library only: runs before (or without) the project's own install.
PYTHONPATH="$repo/tools:$repo${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m dscache_tools.devcluster.images "$@"
