"""Cache admission by cost: the calibrated range, refined by live timings, with probes."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import numpy as np
import pytest
from dscache_server.admission import Admission, AdmissionRange, CostModel
from dscache_server.metrics import ServerMetrics
from srv_helpers import BLOCK_TOKENS, LiveServer

BT = 256
MAX = 64 * BT

# Recompute 1 ms/token; load 2 ms fixed + 0.1 ms/token: loading pays from 3 tokens on.
FAST_DISK = CostModel(
    prefill_tokens_per_s=1000.0, load_bytes_per_s=1e8, lookup_overhead_s=0.002,
    bytes_per_token=10_000,
)  # fmt: skip
# Loading costs 5 ms/token, more than the 1 ms/token recompute: it never pays.
SLOW_DISK = CostModel(1000.0, 2e6, 0.0, 10_000)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _gauge(m: ServerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_the_calibrated_model_loads_from_the_first_paying_block_to_the_context() -> None:
    m = ServerMetrics()
    a = Admission(FAST_DISK, block_tokens=BT, max_tokens=MAX, metrics=m)
    assert a.range == AdmissionRange(BT, MAX)
    assert a.decide(BT) == "admit" and a.decide(MAX) == "admit"
    assert a.decide(0) == "no_gain"  # no whole block before the last token
    assert _gauge(m, "dscache_server_cache_crossover_tokens") == BT
    assert _gauge(m, "dscache_server_cache_admission_upper_tokens") == MAX
    per_token = _gauge(m, "dscache_server_cache_cost_seconds_per_token", path="recompute",
                       tokens=str(BT))  # fmt: skip
    assert per_token == pytest.approx(1e-3)


def test_a_store_slower_than_recompute_loads_nothing() -> None:
    m = ServerMetrics()
    a = Admission(SLOW_DISK, block_tokens=BT, max_tokens=MAX, metrics=m)
    assert a.range == AdmissionRange(0, 0)
    assert all(a.decide(n * BT) == "no_gain" for n in range(1, 65))
    assert _gauge(m, "dscache_server_cache_crossover_tokens") == -1
    assert _gauge(m, "dscache_server_cache_admission_upper_tokens") == -1


def test_live_timings_close_the_range_above_where_loads_turn_slow() -> None:
    """Loads of up to 8 blocks measured fast, 9 blocks and more as slow as a disk
    that cannot keep up: an upper bound appears at 8 blocks; a probe still goes
    through now and then so the slow sizes keep being measured."""
    clock = Clock()
    m = ServerMetrics()
    a = Admission(FAST_DISK, block_tokens=BT, max_tokens=MAX, refit_s=5.0, metrics=m,
                  clock=clock)  # fmt: skip
    for _ in range(4):
        for blocks in (1, 2, 4, 8):
            a.observe("load", blocks * BT, blocks * BT * 1e-4)
        for blocks in (16, 32, 64):
            a.observe("load", blocks * BT, blocks * BT * 3e-3)  # 3x the recompute
        for blocks in (1, 4, 16, 64):
            a.observe("recompute", blocks * BT, blocks * BT * 1e-3)
    assert a.range == AdmissionRange(BT, MAX)  # not refitted yet: under 5 s
    clock.now = 5.0
    a.observe("recompute", BT, BT * 1e-3)
    assert a.range == AdmissionRange(BT, 8 * BT)
    assert a.decide(8 * BT) == "admit"
    assert a.decide(9 * BT) == "no_gain"  # probe share 0
    assert _gauge(m, "dscache_server_cache_admission_upper_tokens") == 8 * BT
    slow = _gauge(m, "dscache_server_cache_cost_seconds_per_token", path="load",
                  tokens=str(16 * BT))  # fmt: skip
    assert slow == pytest.approx(3e-3)


def test_live_timings_open_the_range_when_recompute_is_slower_than_calibrated() -> None:
    a = Admission(SLOW_DISK, block_tokens=BT, max_tokens=MAX, refit_s=0.0, min_samples=2)
    assert a.range == AdmissionRange(0, 0)
    for _ in range(2):
        a.observe("recompute", 4 * BT, 4 * BT * 1e-2)  # 10 ms/token: a loaded machine
    # Class 4 blocks (3..4 blocks) now pays; the rest still does not.
    assert a.range == AdmissionRange(3 * BT, 4 * BT)


def test_probes_admit_a_bounded_share_of_refused_prompts() -> None:
    a = Admission(SLOW_DISK, block_tokens=BT, max_tokens=MAX, probe=0.1, seed=7)
    decisions = [a.decide(4 * BT) for _ in range(2000)]
    probes = decisions.count("probe")
    assert set(decisions) == {"probe", "no_gain"}
    assert 100 < probes < 300  # about 10%
    never = Admission(SLOW_DISK, block_tokens=BT, max_tokens=MAX, probe=0.0)
    assert {never.decide(4 * BT) for _ in range(200)} == {"no_gain"}


def test_a_range_shut_by_a_slow_moment_reopens_from_timed_probes() -> None:
    """A canary's sidecar, busy writing its prewarm's blocks, answers four leases
    slowly: loads of 5..8 blocks measure 3x the recompute and that class is refused.
    The moment passes. Refused prompts still send one timed probe per class every
    refit period, the slow samples age out, and the class is admitted again within
    a minute: a share of 2% alone would need hundreds of that class's requests."""

    def run(**recovery: float | None) -> list[AdmissionRange]:
        clock = Clock()
        a = Admission(FAST_DISK, block_tokens=BT, max_tokens=MAX, refit_s=5.0, clock=clock,
                      **recovery)  # fmt: skip
        for _ in range(4):
            a.observe("load", 8 * BT, 8 * BT * 3e-3)
        ranges = []
        for second in range(5, 65, 5):
            clock.now = float(second)
            for _ in range(20):  # 20 prompts of the refused class per period
                if a.decide(8 * BT) in ("admit", "probe"):
                    a.observe("load", 8 * BT, 8 * BT * 1e-4)  # fast again
                else:
                    a.observe("recompute", 8 * BT, 8 * BT * 1e-3)
            ranges.append(a.range)
        return ranges

    timed = run(probe_every_s=5.0, max_age_s=30.0)
    assert timed[0] == AdmissionRange(BT, 4 * BT)  # shut above 4 blocks by the slow loads
    assert timed[-1] == AdmissionRange(BT, MAX)  # open again
    # Share-less and ageless (the old behaviour), the class stays refused: no load
    # sample ever replaces the slow ones.
    assert run(probe_every_s=None, max_age_s=None)[-1] == AdmissionRange(BT, 4 * BT)


def test_timed_probes_are_one_per_size_class_and_period() -> None:
    clock = Clock()
    a = Admission(SLOW_DISK, block_tokens=BT, max_tokens=MAX, probe_every_s=10.0, clock=clock)
    assert {a.decide(4 * BT) for _ in range(50)} == {"no_gain"}  # none before a period
    clock.now = 10.0
    first = [a.decide(4 * BT) for _ in range(50)]
    other = [a.decide(16 * BT) for _ in range(50)]
    assert first.count("probe") == 1 and other.count("probe") == 1
    clock.now = 15.0
    assert {a.decide(4 * BT) for _ in range(50)} == {"no_gain"}
    clock.now = 20.0
    assert [a.decide(3 * BT) for _ in range(5)].count("probe") == 1  # 3 blocks: same class


def test_bad_samples_are_ignored_and_bad_settings_refused() -> None:
    a = Admission(FAST_DISK, block_tokens=BT, max_tokens=MAX, refit_s=0.0, min_samples=1)
    for tokens, seconds in ((0, 1.0), (BT, 0.0), (BT, float("nan")), (-5, 1.0)):
        a.observe("load", tokens, seconds)
    assert a.range == AdmissionRange(BT, MAX)
    # A sample past the context length lands in the largest class.
    a.observe("load", 10 * MAX, 10 * MAX * 1.0)
    assert a.range.upper < MAX
    with pytest.raises(ValueError, match="probe"):
        Admission(FAST_DISK, block_tokens=BT, max_tokens=MAX, probe=1.5)
    with pytest.raises(ValueError, match="refit_s"):
        Admission(FAST_DISK, block_tokens=BT, max_tokens=MAX, refit_s=-1.0)
    with pytest.raises(ValueError, match="max_age_s"):
        Admission(FAST_DISK, block_tokens=BT, max_tokens=MAX, max_age_s=-1.0)


# ---------------------------------------------------------------- through the server


def _ids(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(2, 120_000, size=n)]


def _cached(c: httpx.Client, prompt: list[int]) -> int:
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_without_a_floor_a_one_block_prompt_is_reused(
    live_server: Callable[..., LiveServer],
) -> None:
    """The old fixed threshold skipped every prompt under it; the cost model alone
    loads the one usable block of a short prompt when that beats recomputing it."""
    srv = live_server(min_cache_tokens=0)
    prompt = _ids(BLOCK_TOKENS + 5, seed=81)
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        assert _cached(c, prompt) == 0
        assert srv.runtime.cache.wait_stored(30)
        assert _cached(c, prompt) == BLOCK_TOKENS
    assert srv.metric("dscache_server_cache_admission_total", decision="admit") == 2
    floored = live_server(min_cache_tokens=4 * BLOCK_TOKENS)
    with httpx.Client(base_url=floored.url, timeout=120) as c:
        assert _cached(c, prompt) == 0  # the floor still wins where it is set
    assert floored.metric("dscache_server_cache_admission_total", decision="short") == 1


def test_live_timings_correct_a_calibration_that_said_loading_never_pays(
    live_server: Callable[..., LiveServer],
) -> None:
    """Configured as if the store read 1 kB/s, the server loads nothing but its probes;
    the probes' real load times and the real prefill times then replace the wrong
    line, and the same prompts are admitted on cost."""
    srv = live_server(
        load_bytes_per_s=1e3, admission_refit_s=1e-6, admission_probe=1.0, min_cache_tokens=0
    )
    cache = srv.runtime.cache
    assert cache.admission.range == AdmissionRange(0, 0)
    # 9 blocks + 12 tokens: usable prefix 9 blocks, prompt 10 blocks: one size class.
    prompts = [_ids(9 * BLOCK_TOKENS + 12, seed=90 + i) for i in range(4)]
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        for p in prompts:  # recompute samples (each a probe that finds nothing)
            assert _cached(c, p) == 0
        assert cache.wait_stored(30)
        for p in prompts:  # load samples: probes that find all 9 blocks
            assert _cached(c, p) == 9 * BLOCK_TOKENS
        assert cache.admission.range.admits(9 * BLOCK_TOKENS), cache.admission.range
        assert _cached(c, prompts[0]) == 9 * BLOCK_TOKENS
    assert srv.metric("dscache_server_cache_admission_total", decision="admit") >= 1
    assert srv.metric("dscache_server_cache_crossover_tokens") > 0
