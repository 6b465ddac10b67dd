#!/usr/bin/env bash
# Builds (or reuses) dscache's container images without any registry:
#   server  ghcr.io/dscache/dscache:<version>         model server + everything in core
#   core    ghcr.io/dscache/dscache-core:<version>    sidecar, operator, prewarm, load (no torch)
#   router  ghcr.io/dscache/dscache-router:<version>  NGINX with the Lua module
#   pause   dscache.local/pause:1.0                   the dev cluster's pod sandbox
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

need_pkgs=()
for pkg in docker.io debootstrap; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_pkgs+=("$pkg")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "[images] installing Debian packages: ${need_pkgs[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then
    python="$repo/.venv/bin/python"
  else
    python="$(command -v python3)"
  fi
fi

cd "$repo"
# Standard library only: runs before (or without) the project's own install.
PYTHONPATH="$repo/tools:$repo${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m dscache_tools.devcluster.images "$@"
