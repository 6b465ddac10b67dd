# Shell functions the setup and build scripts share; `source` it, do not run it.

# install_debs TAG PKG...: installs those Debian packages that are not installed yet
# (as root, or through sudo), saying so with "[TAG]"; a no-op when all are there.
install_debs() {
  local tag=$1 pkg sudo=""
  shift
  local need=()
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  [ ${#need[@]} -eq 0 ] && return 0
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  printf '[%s] installing Debian packages: %s\n' "$tag" "${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

# repo_python REPO: prints the interpreter to use: $PYTHON, else REPO's .venv, else python3.
repo_python() {
  if [ -n "${PYTHON:-}" ]; then
    printf '%s\n' "$PYTHON"
  elif [ -x "$1/.venv/bin/python" ]; then
    printf '%s\n' "$1/.venv/bin/python"
  else
    command -v python3
  fi
}
