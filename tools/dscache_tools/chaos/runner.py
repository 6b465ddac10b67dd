"""Runs the chaos matrix: one local stack, one load per case, one fault mid-load.

Contract:
    * One stack (router + 2 model servers + 2 sidecars) serves every case; a
      warm-up replay fills the caches first, so every case, baseline included,
      meets warm caches and sends the same requests in the same order.
    * A case's load runs in a worker thread; its fault is done on the main thread
      (children restarted there live as long as this process, see
      :mod:`dscache_tools.procs`) after a third of the requests finished,
      and undone after two thirds. The case ends when both the load and the
      undo have, so the next case starts from the healthy stack.
    * Every child is stopped and every tmpfs unmounted on exit, also on error,
      Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dscache import metricnames as names
from dscache_tools.chaos import counters
from dscache_tools.chaos.cases import CASES, Case
from dscache_tools.chaos.faults import DiskMethod, FaultDriver
from dscache_tools.chaos.report import CaseResult, ChaosReport
from dscache_tools.demo.stack import LocalStack, StackOptions
from dscache_tools.loadgen import LoadConfig, LoadReport, RequestResult, run_load
from dscache_tools.procs import terminate_on_sigterm
from dscache_tools.workload import ChatRequest, WorkloadConfig, generate

log = logging.getLogger(__name__)

#: Per-sidecar cache size and (as root) tmpfs size: small, so a full disk is cheap.
SIDECAR_CAPACITY = "256MiB"
SIDECAR_TMPFS = "320MiB"


@dataclass(frozen=True)
class ChaosOptions:
    """Knobs of ``dscache chaos``.

    Attributes:
        quick: the short profile of the test suite (few requests per case).
        model: model preset of both servers.
        requests: requests per case (None: the profile's, 6 quick, 48 full).
        concurrency: sessions in flight.
        workdir: files and logs (None: a temp dir, removed after the run).
        max_tokens: completion tokens per request.
        threads: torch threads per server.
        seed: workload seed.
    """

    quick: bool = False
    model: str = "tiny-gqa"
    requests: int | None = None
    concurrency: int = 4
    workdir: Path | None = None
    max_tokens: int = 8
    threads: int = 1
    seed: int = 0

    @property
    def per_case(self) -> int:
        """Requests per case after the profile."""
        return self.requests or (6 if self.quick else 48)


def build_workload(opts: ChaosOptions) -> list[ChatRequest]:
    """Sessions enough for one case's requests, from the finance workload."""
    return generate(
        WorkloadConfig(
            sessions=max(opts.concurrency * 2, opts.per_case // 3),
            seed=opts.seed,
            companies=2 if opts.quick else 4,
            max_tokens=opts.max_tokens,
            min_turns=3,
            max_turns=6,
        )
    )


def run_chaos(opts: ChaosOptions, cases: Sequence[Case] = CASES) -> ChaosReport:
    """Starts the stack, runs ``cases`` in order and returns the report."""
    workload = build_workload(opts)
    root = os.geteuid() == 0
    stack_opts = StackOptions(
        model=opts.model,
        threads=opts.threads,
        sidecar_capacity=SIDECAR_CAPACITY,
        sidecar_segment_size="32MiB",
        sidecar_args=("--fault-injection",),
        sidecar_tmpfs=SIDECAR_TMPFS if root else None,
    )
    report = ChaosReport(
        model=opts.model,
        concurrency=opts.concurrency,
        requests_per_case=opts.per_case,
        ttft_kind=f"time to the whole answer (stream: false, max_tokens {opts.max_tokens})",
    )
    with _WorkDir(opts) as workdir, terminate_on_sigterm(), LocalStack(workdir, stack_opts) as st:
        print(f"starting 2 sidecars, 2 model servers ({opts.model}) and NGINX in {workdir} ...")
        st.start_servers(2, cache=True)
        st.start_router()
        driver = FaultDriver(st, "tmpfs" if root else "enospc-fault")
        print("warm-up (not counted) ...", flush=True)
        _load(st, opts, workload, None)
        for case in cases:
            print(f"case {case.name}: {case.fault} ...", flush=True)
            result = run_case(case, driver, opts, workload)
            print(
                f"  {result.requests} requests, {result.failed} failed, TTFT p99 "
                f"{result.ttft_p99_s or 0:.2f}s  {'; '.join(result.notes)}",
                flush=True,
            )
            report.add(result)
    return report


class _WorkDir:
    """The work dir: the given one (kept), or a temp dir removed afterwards."""

    def __init__(self, opts: ChaosOptions) -> None:
        self._tmp = None if opts.workdir else tempfile.TemporaryDirectory(prefix="dscache-chaos-")
        self.path = opts.workdir or Path(self._tmp.name if self._tmp else ".")

    def __enter__(self) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path

    def __exit__(self, *exc: object) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def run_case(
    case: Case, driver: FaultDriver, opts: ChaosOptions, workload: Sequence[ChatRequest]
) -> CaseResult:
    """One case: the load in a thread, the fault and its undo here, mid-load."""
    st = driver.stack
    fallback_urls = [s.metrics_url for s in st.servers]
    router_url = st.router.url + names.ROUTER_METRICS_PATH if st.router else ""
    before = _counts(fallback_urls, router_url)
    third, two_thirds = threading.Event(), threading.Event()
    n = opts.per_case
    done = 0

    def on_result(_res: RequestResult) -> None:
        nonlocal done
        done += 1
        if done >= max(1, n // 3):
            third.set()
        if done >= max(2, 2 * n // 3):
            two_thirds.set()

    notes: list[str] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="chaos-load") as pool:
        future = pool.submit(_load, st, opts, workload, on_result)
        future.add_done_callback(lambda _f: _set(third, two_thirds))
        try:
            third.wait()
            notes.append(case.inject(driver))
            two_thirds.wait()
        finally:
            notes.append(case.undo(driver))
        load = future.result()
    after = _counts([s.metrics_url for s in st.servers], router_url)
    method = driver.disk_method if case.name == "cache_disk_full" else None
    return _result(case, load, notes, method, before=before, after=after)


def _set(*events: threading.Event) -> None:
    for event in events:
        event.set()


def _load(
    st: LocalStack,
    opts: ChaosOptions,
    workload: Sequence[ChatRequest],
    on_result: Callable[[RequestResult], None] | None,
) -> LoadReport:
    assert st.router is not None
    cfg = LoadConfig(
        target=st.router.url,
        concurrency=opts.concurrency,
        requests=opts.per_case,
        timeout_s=300.0,
        stream=False,
        progress=False,
    )
    return asyncio.run(run_load(cfg, workload, on_result=on_result))


def _counts(server_urls: Sequence[str], router_url: str) -> dict[str, float | None]:
    out = {u: counters.read(u, counters.FALLBACKS) for u in server_urls}
    if router_url:
        out[router_url] = counters.read(router_url, counters.ROUTER_PREFIX, prefix=True)
    return out


def _result(
    case: Case,
    load: LoadReport,
    notes: list[str],
    method: DiskMethod | None,
    *,
    before: dict[str, float | None],
    after: dict[str, float | None],
) -> CaseResult:
    router = {k for k in after if k.endswith(names.ROUTER_METRICS_PATH)}
    return CaseResult(
        name=case.name,
        fault=case.fault,
        requests=load.requests,
        failed=load.errors,
        ttft_p99_s=load.ttft_p99_s,
        ttft_p50_s=load.ttft_p50_s,
        duration_s=load.duration_s,
        method=method,
        fallbacks=counters.delta(
            {k: v for k, v in before.items() if k not in router},
            {k: v for k, v in after.items() if k not in router},
        ),
        retries=counters.delta(
            {k: v for k, v in before.items() if k in router},
            {k: v for k, v in after.items() if k in router},
        ),
        load_avg=os.getloadavg()[0],
        notes=[n for n in notes if n],
        error_kinds=load.error_kinds,
    )
