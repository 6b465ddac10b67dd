"""Eviction signals from vLLM (``dscache_vllm.signals``): sent off the scheduler's loop,
never a failure of vLLM's. The end-to-end path (header, vLLM, connector, sidecar) is
in ``tests/vllm/test_serve.py``."""

from __future__ import annotations

from pathlib import Path

from dscache_sidecar.client import SidecarClient
from dscache_tools.polling import wait_until
from dscache_vllm.metrics import ConnectorMetrics
from dscache_vllm.signals import DelayedSignals
from prometheus_client import CollectorRegistry


def test_a_signal_to_a_dead_sidecar_is_counted_and_never_raises(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    metrics = ConnectorMetrics.create(registry)
    with SidecarClient(str(tmp_path / "no-sidecar.sock"), timeout_s=0.5) as client:
        signals = DelayedSignals(client, metrics, delay_s=0.0)
        signals.send("tenant", [b"k" * 32], "ended")  # returns: the thread sends it
        signals.send("tenant", [], "ended")  # nothing stored: nothing sent
        wait_until(
            "the failure counted",
            lambda: registry.get_sample_value("dscache_vllm_signal_failures_total") == 1.0,
            timeout=10,
        )
        signals.close()
        signals.send("tenant", [b"k" * 32], "ended")  # after close: ignored
    assert registry.get_sample_value("dscache_vllm_signal_failures_total") == 1.0
    assert registry.get_sample_value("dscache_vllm_signals_total", {"kind": "ended"}) is None
    assert metrics.take() == {"signal_failures": 1.0}
