"""The worker side against a real sidecar daemon: saves, loads, and every way a load fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dscache_sidecar.client import SidecarClient
from dscache_tools.sidecarproc import SidecarProcess
from dscache_vllm.metrics import ConnectorMetrics
from dscache_vllm.paged import PagedKV
from dscache_vllm.plan import LoadSpec, SaveSpec
from dscache_vllm.worker import KVWorker
from prometheus_client import CollectorRegistry
from vllm_helpers import flip_block

from dscache.keys import KeyChain, KVLayout, LayoutKind, ModelFingerprint, tenant_salt

PAGE, BLOCK, PAGES = 128, 256, 16
FP = ModelFingerprint(
    "m", "r", KVLayout(LayoutKind.GQA, 2, "float32", num_kv_heads=2, head_dim=64, v_head_dim=64)
)
CHAIN = KeyChain(FP, tenant_salt("t"))
TOKENS = list(range(3000, 3000 + 3 * BLOCK))
KEYS = CHAIN.keys(TOKENS)


def kv(fill: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randn(PAGES, 2, PAGE, 128, generator=g) if fill else torch.zeros(PAGES, 2, PAGE, 128)
        for _ in range(2)
    ]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[SidecarProcess]:
    proc = SidecarProcess(tmp_path / "store", "--capacity", "64MiB", "--segment-size", "16MiB")
    proc.start()
    yield proc
    proc.stop()


def worker(
    daemon: SidecarProcess, layers: list[torch.Tensor], **kw: int
) -> tuple[KVWorker, CollectorRegistry]:
    registry = CollectorRegistry()
    client = SidecarClient(daemon.socket, data_dir=str(daemon.data_dir))
    return KVWorker(
        client, PagedKV(layers, BLOCK, PAGE, PAGES), ConnectorMetrics.create(registry), **kw
    ), registry


def save_all(w: KVWorker) -> None:
    parents = (b"", KEYS[0], KEYS[1])
    w.save(SaveSpec("r", CHAIN.tenant, tuple(KEYS), parents, tuple(range(6))))
    assert w.wait_idle(30)


def load_spec(pages: tuple[int, ...]) -> LoadSpec:
    return LoadSpec("r2", CHAIN.tenant, tuple(KEYS), 0, 0, pages)


@pytest.mark.slow
def test_saved_blocks_load_into_other_pages_exactly(daemon: SidecarProcess) -> None:
    src = kv(fill=True)
    saver, reg = worker(daemon, src)
    save_all(saver)
    assert reg.get_sample_value("dscache_vllm_stored_blocks_total") == 3
    dst = kv(fill=False)
    loader, reg2 = worker(daemon, dst)
    assert loader.load(load_spec((10, 11, 12, 13, 14, 15))) == set()
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[10:16], s[0:6])
    assert reg2.get_sample_value("dscache_vllm_loaded_tokens_total") == 6 * PAGE
    saver.close()
    loader.close()


@pytest.mark.slow
def test_a_corrupt_block_stops_the_load_and_is_recomputed(daemon: SidecarProcess) -> None:
    saver, _ = worker(daemon, kv(fill=True))
    save_all(saver)
    flip_block(saver.client, daemon.data_dir, CHAIN.tenant, KEYS[1])
    dst = kv(fill=False)
    loader, reg = worker(daemon, dst)
    missing = loader.load(load_spec((10, 11, 12, 13, 14, 15)))
    assert missing == {12, 13, 14, 15}
    assert reg.get_sample_value("dscache_vllm_load_failures_total", {"reason": "missing"}) == 4
    assert float(dst[0][12].abs().sum()) == 0  # nothing of the bad block was copied
    saver.close()
    loader.close()


def test_a_dead_sidecar_fails_no_load_and_no_save(daemon: SidecarProcess) -> None:
    w, reg = worker(daemon, kv(fill=True))
    save_all(w)
    daemon.kill()
    assert w.load(load_spec((10, 11))) == {10, 11}
    assert reg.get_sample_value("dscache_vllm_load_failures_total", {"reason": "unavailable"}) == 2
    w.save(SaveSpec("r", CHAIN.tenant, (KEYS[0],), (b"",), (0, 1)))
    assert w.wait_idle(30)
    assert reg.get_sample_value("dscache_vllm_store_failures_total") == 1
    w.close()


@pytest.mark.slow
def test_a_full_write_queue_drops_blocks_instead_of_waiting(daemon: SidecarProcess) -> None:
    w, reg = worker(daemon, kv(fill=True), queue_blocks=2)
    w.save(SaveSpec("r", CHAIN.tenant, tuple(KEYS), (b"", KEYS[0], KEYS[1]), tuple(range(6))))
    assert w.wait_idle(30)
    assert reg.get_sample_value("dscache_vllm_store_dropped_blocks_total") == 3
    w.close()
