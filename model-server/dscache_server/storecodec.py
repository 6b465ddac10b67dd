"""Which codec each store job uses: the deployment's choice, and adaptive zstd.

Contract:
    * ``StorePolicy.choose(ids)`` returns the ``Encoding`` of one store job (the
      new full blocks of one prompt), the sidecar client's one vocabulary: the
      layers below carry it to the encoder unchanged; it never raises and costs
      microseconds next to the job (it runs on the writer thread, off the
      request path, as the encoding itself does).
    * ``raw``, ``zstd`` and ``int8`` are fixed: every block so. ``int8`` is lossy:
      its blocks sit under their own keys (``kv_codec`` in the fingerprint).
    * ``auto`` is the adaptive zstd policy:
        1. prompts under ``min_tokens`` (4096) stay raw: short contexts reload
           fast from the page cache and zero-copy hits matter more than bytes;
        2. prompts whose text repeats little stay raw: the share of token
           n-grams (``ngram`` = 4) in the last ``window`` tokens that already
           occurred earlier in that window must reach ``min_repetition`` (0.15);
        3. the level follows the measured CPU headroom (the container's quota
           when it has one, the host's otherwise): plenty -> level 3, some ->
           1, little -> -1 (zstd's fast mode), none -> raw;
        4. each block is still sampled (the sidecar codec's policy): a block that
           does not shrink stays raw, so its hits stay zero-copy.
    * Every decision is counted in ``dscache_server_store_codec_total{codec,reason}``
      (``codec`` is the ``Encoding``'s name: ``raw``, ``zstd``, ``int8``, ``sample``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dscache_sidecar.client import RAW, Encoding
from prometheus_client import Counter

from dscache_server.config import StoreMode


def repetition(ids: Sequence[int], *, window: int = 4096, ngram: int = 4) -> float:
    """Share of the n-grams in the last ``window`` tokens seen earlier in that window."""
    tail = list(ids[-window:])
    total = len(tail) - ngram + 1
    if total <= 0:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for i in range(total):
        gram = tuple(tail[i : i + ngram])
        if gram in seen:
            repeated += 1
        else:
            seen.add(gram)
    return repeated / total


class CpuHeadroom:
    """The idle share of the CPU this process may use, over the last interval.

    Reads the cgroup v2 quota and usage (``cpu.max``, ``cpu.stat``) when the
    container has a quota, else the host's idle share (psutil). Samples at most
    once per ``min_interval_s``; the first call measures over ``min_interval_s``
    since construction.
    """

    def __init__(self, cgroup: Path = Path("/sys/fs/cgroup"), min_interval_s: float = 1.0):
        self._cgroup = cgroup
        self._min_interval = min_interval_s
        self._lock = threading.Lock()
        self._quota = self._read_quota()
        self._last = (time.monotonic(), self._usage_s())
        self._value = 1.0
        if self._quota is None:
            import psutil

            self._psutil = psutil
            psutil.cpu_percent(interval=None)  # starts psutil's interval

    def _read_quota(self) -> float | None:
        """CPUs the cgroup may use, None without a limit."""
        try:
            quota, period = (self._cgroup / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            return None
        if quota == "max":
            return None
        return int(quota) / int(period)

    def _usage_s(self) -> float:
        if self._quota is None:
            return 0.0
        try:
            for line in (self._cgroup / "cpu.stat").read_text().splitlines():
                name, value = line.split()
                if name == "usage_usec":
                    return int(value) / 1e6
        except (OSError, ValueError):
            pass
        return 0.0

    def __call__(self) -> float:
        """Headroom in [0, 1]: 1 = idle, 0 = every allowed CPU busy."""
        with self._lock:
            now = time.monotonic()
            if now - self._last[0] < self._min_interval:
                return self._value
            usage = self._usage_s()
            if self._quota is None:
                busy = self._psutil.cpu_percent(interval=None) / 100.0
            else:
                busy = (usage - self._last[1]) / ((now - self._last[0]) * self._quota)
            self._last = (now, usage)
            self._value = min(1.0, max(0.0, 1.0 - busy))
            return self._value


@dataclass(frozen=True)
class AdaptiveZstd:
    """The ``auto`` policy's thresholds (see the module contract).

    Attributes:
        min_tokens: prompts shorter than this stay raw, tokens.
        min_repetition: n-gram repetition share below which a prompt stays raw.
        window: tokens the repetition is measured over (the prompt's last).
        ngram: n of the n-grams.
        levels: ``(headroom floor, level)`` pairs, highest floor first; below the
            last floor the blocks stay raw.
    """

    min_tokens: int = 4096
    min_repetition: float = 0.15
    window: int = 4096
    ngram: int = 4
    levels: tuple[tuple[float, int], ...] = ((0.6, 3), (0.3, 1), (0.15, -1))


class StorePolicy:
    """Chooses each store job's codec (see the module contract).

    Args:
        mode: the deployment's choice.
        adaptive: thresholds of ``auto``.
        headroom: CPU headroom probe (default: ``CpuHeadroom``).
        decisions: counter labelled ``codec`` and ``reason`` (None: not counted).
    """

    def __init__(
        self,
        mode: StoreMode,
        *,
        adaptive: AdaptiveZstd | None = None,
        headroom: Callable[[], float] | None = None,
        decisions: Counter | None = None,
    ) -> None:
        self._fixed = None if mode == "auto" else Encoding.named(mode)  # raises on a typo
        self.adaptive = adaptive or AdaptiveZstd()
        self._headroom = headroom if headroom is not None or mode != "auto" else CpuHeadroom()
        self._decisions = decisions

    def choose(self, ids: Sequence[int]) -> Encoding:
        """The codec of the store job of a prompt with token ids ``ids``."""
        encoding, reason = self._choose(ids)
        if self._decisions is not None:
            self._decisions.labels(codec=encoding.name, reason=reason).inc()
        return encoding

    def _choose(self, ids: Sequence[int]) -> tuple[Encoding, str]:
        if self._fixed is not None:
            return self._fixed, "fixed"
        a = self.adaptive
        if len(ids) < a.min_tokens:
            return RAW, "short"
        if repetition(ids, window=a.window, ngram=a.ngram) < a.min_repetition:
            return RAW, "low_repetition"
        headroom = self._headroom() if self._headroom is not None else 1.0
        for floor, level in a.levels:
            if headroom >= floor:
                return Encoding(None, level), "chosen"
        return RAW, "no_headroom"
