"""Cache admission by cost: load a prefix only where loading beats recomputing it.

The start-up calibration (:mod:`.calibrate`) gives a :class:`CostModel`, two lines:
recompute seconds and load seconds against tokens. While the server runs, its own
requests refine it: a prompt prefilled from nothing is a recompute sample (tokens,
seconds of its own compute), a restored prefix a load sample (tokens, seconds of
lookup + lease + map and checksum wait). Samples are kept per size class (1, 2, 4,
8, ... blocks; the last ``window`` of each) and the model is refitted at most every
``refit_s`` seconds: a class with ``min_samples`` samples is costed at its median
seconds per token, the others on the calibrated line.

Admission then loads a prompt's usable prefix when its size lies in the range
``[lower, upper]`` where loading is the cheaper of the two. ``lower`` is the
classic crossover (a few blocks pay the lookup and lease overhead); ``upper``
exists when loading grows dearer per token with size faster than recomputing: a
prefix that outgrows the page cache and is read from disk, or arrives from the
shared tier, against a fast accelerator's prefill. Where loading pays up to the
context length, ``upper`` is the context length.

Contract:
    * Decisions are ``admit``, ``no_gain`` or ``probe``; the floor (``short``) and a
      missing store (``disabled``) are the caller's.
    * A share ``probe`` of refused prompts is admitted anyway, and with
      ``probe_every_s`` one refused prompt of each size class per that many seconds
      (one whose class had no load sample in that time), so the sizes the model
      refuses keep being measured and a range that shrank on a slow moment widens
      again within seconds, whatever the traffic: a share alone brings a class back
      only after hundreds of its requests (its median needs fresh samples).
    * Samples older than ``max_age_s`` are dropped at each refit: a slow moment (a
      sidecar starved of CPU while it writes a prewarm's blocks) stops counting
      once it is over, and a class left without fresh samples is costed on the
      calibrated line again.
    * Samples never raise and never block: a refit is a few medians, done on the
      call that finds the last refit ``refit_s`` old. ``refit_s`` None keeps the
      calibrated model for the process's life.
    * Every refit updates the metrics: the range
      (``dscache_server_cache_crossover_tokens`` = lower,
      ``dscache_server_cache_admission_upper_tokens``; both -1 when loading never
      pays) and the estimated seconds per token of each class and path.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from dscache_server.metrics import ServerMetrics

log = logging.getLogger(__name__)

Path = Literal["load", "recompute"]
PATHS: tuple[Path, ...] = ("load", "recompute")
Decision = Literal["admit", "no_gain", "probe"]


@dataclass
class CostModel:
    """Store-vs-recompute: does reading ``n`` cached tokens beat recomputing them?

    Attributes:
        prefill_tokens_per_s: measured prefill speed.
        load_bytes_per_s: measured cache read speed (lease + map + first touch).
        lookup_overhead_s: fixed cost of lookup + lease.
        bytes_per_token: KV bytes per token of this model.
    """

    prefill_tokens_per_s: float
    load_bytes_per_s: float
    lookup_overhead_s: float
    bytes_per_token: int

    def load_cost_s(self, tokens: int) -> float:
        """Seconds to restore ``tokens`` from the cache."""
        return self.lookup_overhead_s + tokens * self.bytes_per_token / self.load_bytes_per_s

    def recompute_cost_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` (linear model; prefill only grows faster)."""
        return tokens / self.prefill_tokens_per_s

    def cost_s(self, path: Path, tokens: int) -> float:
        """``load_cost_s`` or ``recompute_cost_s``."""
        return self.load_cost_s(tokens) if path == "load" else self.recompute_cost_s(tokens)

    def crossover_tokens(self) -> int | None:
        """Smallest token count where loading pays; None if it never does."""
        per_token_gain = 1.0 / self.prefill_tokens_per_s - (
            self.bytes_per_token / self.load_bytes_per_s
        )
        if per_token_gain <= 0:
            return None
        return int(self.lookup_overhead_s / per_token_gain) + 1


@dataclass(frozen=True)
class AdmissionRange:
    """Usable prefix sizes (tokens, whole blocks) that are loaded: ``lower..upper``.

    ``lower == upper == 0``: loading never pays, nothing is loaded.
    """

    lower: int
    upper: int

    def admits(self, tokens: int) -> bool:
        """Whether a usable prefix of ``tokens`` is inside the range."""
        return self.upper > 0 and self.lower <= tokens <= self.upper


class Admission:
    """The per-request decision, from the calibrated model refined by live timings.

    Args:
        cost: the start-up calibration (the fallback of every class without samples).
        block_tokens: tokens per block (prefix sizes are whole blocks).
        max_tokens: the longest prefix considered (the context length).
        refit_s: refit the model from the samples at most this often; None: never
            (the calibrated model stays).
        window: samples kept per size class and path.
        min_samples: samples a class needs before its median replaces the line.
        probe: share of refused prompts admitted anyway (0 <= probe <= 1).
        probe_every_s: also admit one refused prompt per size class this often,
            seconds (None: the share alone).
        max_age_s: samples older than this many seconds are dropped at a refit
            (None: kept until the window pushes them out).
        metrics: where the range and the estimates are exported (None: nowhere).
        seed: seed of the probe draws.
        clock: monotonic seconds (tests inject one).
    """

    def __init__(
        self,
        cost: CostModel,
        *,
        block_tokens: int,
        max_tokens: int,
        refit_s: float | None = None,
        window: int = 32,
        min_samples: int = 4,
        probe: float = 0.0,
        probe_every_s: float | None = None,
        max_age_s: float | None = 60.0,
        metrics: ServerMetrics | None = None,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_tokens < 1 or max_tokens < 1:
            raise ValueError("block_tokens and max_tokens must be >= 1")
        if not 0.0 <= probe <= 1.0:
            raise ValueError(f"probe must be within [0, 1], got {probe}")
        for name, value in (
            ("refit_s", refit_s),
            ("probe_every_s", probe_every_s),
            ("max_age_s", max_age_s),
        ):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.cost = cost
        self.block_tokens = block_tokens
        self.max_blocks = max(max_tokens // block_tokens, 1)
        self.refit_s = refit_s
        self.min_samples = max(min_samples, 1)
        self.probe = probe
        self.probe_every_s = probe_every_s
        self.max_age_s = max_age_s
        self.metrics = metrics
        self._clock = clock
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._classes = (self.max_blocks - 1).bit_length() + 1
        # (monotonic time, seconds per token), newest last
        self._samples: dict[Path, list[deque[tuple[float, float]]]] = {
            p: [deque(maxlen=max(window, 1)) for _ in range(self._classes)] for p in PATHS
        }
        # per size class: when it last had a load sample or a timed probe
        self._last_load = [clock()] * self._classes
        self._per_token: dict[Path, list[float | None]] = {p: [None] * self._classes for p in PATHS}
        self._last_refit = clock()
        self.range = self._fit()
        self._export()

    # ------------------------------------------------------------------ decisions

    def decide(self, usable_tokens: int) -> Decision:
        """``admit`` when loading ``usable_tokens`` is in the range, else ``no_gain``
        or, for a ``probe`` share of those and the first of its size class in
        ``probe_every_s``, ``probe`` (loaded to be measured)."""
        if self.range.admits(usable_tokens):
            return "admit"
        if usable_tokens <= 0:
            return "no_gain"
        with self._lock:
            if self.probe_every_s is not None:
                c, now = self._class_of(usable_tokens), self._clock()
                if now - self._last_load[c] >= self.probe_every_s:
                    self._last_load[c] = now  # one timed probe per class and period
                    return "probe"
            if self.probe > 0 and self._rng.random() < self.probe:
                return "probe"
        return "no_gain"

    # ------------------------------------------------------------------ samples

    def observe(self, path: Path, tokens: int, seconds: float) -> None:
        """One measured load or recompute of ``tokens`` tokens; may refit."""
        if tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        c, now = self._class_of(tokens), self._clock()
        with self._lock:
            self._samples[path][c].append((now, seconds / tokens))
            if path == "load":
                self._last_load[c] = now
        if self.refit_s is not None and now - self._last_refit >= self.refit_s:
            self.refit()

    def refit(self) -> AdmissionRange:
        """Recomputes the estimates and the range from the samples now."""
        with self._lock:
            now = self._clock()
            for path in PATHS:
                for i, samples in enumerate(self._samples[path]):
                    if self.max_age_s is not None:
                        while samples and now - samples[0][0] > self.max_age_s:
                            samples.popleft()
                    enough = len(samples) >= self.min_samples
                    median = statistics.median(x for _, x in samples) if enough else None
                    self._per_token[path][i] = median
            self._last_refit = now
            old, self.range = self.range, self._fit()
        if self.range != old:
            log.info(
                "admission range %d..%d tokens (was %d..%d)",
                self.range.lower,
                self.range.upper,
                old.lower,
                old.upper,
            )
        self._export()
        return self.range

    # ------------------------------------------------------------------ the model

    def _class_of(self, tokens: int) -> int:
        """Size class: 0 for one block, i for up to 2**i blocks."""
        blocks = max(-(-tokens // self.block_tokens), 1)
        return min((blocks - 1).bit_length(), self._classes - 1)

    def cost_s(self, path: Path, tokens: int) -> float:
        """Estimated seconds to load or recompute ``tokens`` tokens."""
        per_token = self._per_token[path][self._class_of(tokens)]
        if per_token is None:
            return self.cost.cost_s(path, tokens)
        return per_token * tokens

    def _fit(self) -> AdmissionRange:
        bt = self.block_tokens
        lower = upper = 0
        for blocks in range(1, self.max_blocks + 1):
            n = blocks * bt
            if self.cost_s("load", n) < self.cost_s("recompute", n):
                lower, upper = lower or n, n
            elif lower:
                break  # the first run of paying sizes is the range
        return AdmissionRange(lower, upper)

    def _export(self) -> None:
        m = self.metrics
        if m is None:
            return
        r = self.range
        m.crossover_tokens.set(r.lower if r.upper else -1)
        m.admission_upper_tokens.set(r.upper if r.upper else -1)
        for path in PATHS:
            for i in range(self._classes):
                n = min((1 << i) * self.block_tokens, self.max_blocks * self.block_tokens)
                m.cost_per_token.labels(path=path, tokens=str(n)).set(self.cost_s(path, n) / n)
