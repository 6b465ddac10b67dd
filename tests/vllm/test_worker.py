"""The worker side against a real sidecar daemon: saves, loads, and every way a load fails."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dscache_sidecar.client import SidecarClient
from dscache_tools.sidecarproc import SidecarProcess
from dscache_vllm.metrics import ConnectorMetrics
from dscache_vllm.paged import PagedKV
from dscache_vllm.plan import LoadSpec, SaveSpec
from dscache_vllm.worker import KVWorker
from prometheus_client import CollectorRegistry
from vllm_helpers import DEVICES, flip_block

from dscache.keys import KeyChain, KVLayout, LayoutKind, ModelFingerprint, tenant_salt

PAGE, BLOCK, PAGES = 128, 256, 16
FP = ModelFingerprint(
    "m", "r", KVLayout(LayoutKind.GQA, 2, "float32", num_kv_heads=2, head_dim=64, v_head_dim=64)
)
CHAIN = KeyChain(FP, tenant_salt("t"))
TOKENS = list(range(3000, 3000 + 3 * BLOCK))
KEYS = CHAIN.keys(TOKENS)


def kv(fill: bool, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(PAGES, 2, PAGE, 128, generator=g) if fill else torch.zeros(PAGES, 2, PAGE, 128))
        .to(device)
        for _ in range(2)
    ]  # fmt: skip


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[SidecarProcess]:
    proc = SidecarProcess(tmp_path / "store", "--capacity", "64MiB", "--segment-size", "16MiB")
    proc.start()
    yield proc
    proc.stop()


def worker(
    daemon: SidecarProcess, layers: list[torch.Tensor], **kw: Any
) -> tuple[KVWorker, CollectorRegistry]:
    registry = CollectorRegistry()
    data_dir = str(daemon.data_dir)
    client = SidecarClient(daemon.socket, data_dir=data_dir)
    paged = PagedKV(layers, BLOCK, PAGE, PAGES)
    metrics = ConnectorMetrics.create(registry)
    return KVWorker(client, paged, metrics, data_dir=data_dir, **kw), registry


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
def test_a_corrupt_block_checked_in_the_background_is_reported_and_recomputed(
    daemon: SidecarProcess,
) -> None:
    saver, _ = worker(daemon, kv(fill=True))
    save_all(saver)
    flip_block(saver.client, daemon.data_dir, CHAIN.tenant, KEYS[1])
    dst = kv(fill=False)
    loader, reg = worker(daemon, dst)
    # The copies run while the check does: the bad block's pages (and every later
    # one) are reported in the same step, so vLLM recomputes them.
    missing = loader.load(load_spec((10, 11, 12, 13, 14, 15)))
    assert missing == {12, 13, 14, 15}
    assert reg.get_sample_value("dscache_vllm_load_failures_total", {"reason": "corrupt"}) == 4
    assert reg.get_sample_value("dscache_vllm_loaded_tokens_total") == 2 * PAGE
    # The daemon was told: the block is gone, the next lookup stops before it.
    assert loader.client.find(CHAIN.tenant, KEYS).found == 1
    saver.close()
    loader.close()


def test_a_corrupt_block_checked_before_the_copy_is_never_copied(daemon: SidecarProcess) -> None:
    saver, _ = worker(daemon, kv(fill=True))
    save_all(saver)
    flip_block(saver.client, daemon.data_dir, CHAIN.tenant, KEYS[1])
    dst = kv(fill=False)
    loader, reg = worker(daemon, dst, verify="sync")
    missing = loader.load(load_spec((10, 11, 12, 13, 14, 15)))
    assert missing == {12, 13, 14, 15}
    assert reg.get_sample_value("dscache_vllm_load_failures_total", {"reason": "missing"}) == 4
    assert float(dst[0][12].abs().sum()) == 0  # nothing of the bad block was copied
    saver.close()
    loader.close()


def test_a_load_from_inside_a_block_is_exact_and_its_whole_block_is_checked(
    daemon: SidecarProcess,
) -> None:
    """A load that starts at a block's second page (vLLM's own prefix cache held the
    first) gets exactly the stored pages, and the block's first page, not loaded, is
    still part of its check: a flipped byte there fails the block (and every later
    one) for a fresh worker."""
    src = kv(fill=True)
    saver, _ = worker(daemon, src)
    save_all(saver)
    pages = (9, 10, 11, 12, 13)
    spec = LoadSpec("r2", CHAIN.tenant, tuple(KEYS), 0, 1, pages)  # chain pages 1..5
    dst = kv(fill=False)
    loader, _ = worker(daemon, dst)
    assert loader.load(spec) == set()
    assert loader.checked_loads == 1
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[9:14], s[1:6])
    flip_block(saver.client, daemon.data_dir, CHAIN.tenant, KEYS[0])  # in page 0, layer 0
    fresh, reg = worker(daemon, kv(fill=False))
    assert fresh.load(spec) == set(pages)
    assert reg.get_sample_value("dscache_vllm_load_failures_total", {"reason": "corrupt"}) == 5
    saver.close()
    loader.close()
    fresh.close()


def test_a_truncated_segment_recomputes_from_the_cut_block(daemon: SidecarProcess) -> None:
    """A segment file cut short after the blocks were stored: the blocks before the
    cut load, the rest are recomputed (never a SIGBUS on the mapping), and the
    daemon drops the cut block."""
    saver, _ = worker(daemon, kv(fill=True))
    save_all(saver)
    grant = saver.client.lease(CHAIN.tenant, KEYS)
    assert grant is not None and len(grant.blocks) == 3
    cut = grant.blocks[1]
    assert grant.blocks[2].segment == cut.segment and grant.blocks[2].offset > cut.offset
    saver.client.release(grant.lease_id)
    os.truncate(daemon.data_dir / cut.segment, cut.offset + 100)
    loader, reg = worker(daemon, kv(fill=False))
    assert loader.load(load_spec((10, 11, 12, 13, 14, 15))) == {12, 13, 14, 15}
    assert reg.get_sample_value("dscache_vllm_loaded_tokens_total") == 2 * PAGE
    assert loader.client.find(CHAIN.tenant, KEYS).found == 1  # the daemon dropped the cut block
    saver.close()
    loader.close()


@pytest.mark.parametrize(("layerwise", "copy_threads"), [("on", 1), ("on", 3), ("off", 2)])
@pytest.mark.parametrize("device", DEVICES)
def test_layer_by_layer_loads_and_saves_round_trip(
    daemon: SidecarProcess, device: str, layerwise: str, copy_threads: int
) -> None:
    """Saves layer by layer out of vLLM's pages, loads into other pages, not consecutive:
    on the copier thread beside the forward (host pages shared out among
    ``copy_threads`` threads, each layer reported filled once every thread copied
    it), or all before ``start_loads`` returns; on a GPU too (the pages on CUDA, the
    blocks mapped host memory)."""
    src = kv(fill=True, device=device)
    saver, reg = worker(daemon, src)
    spec = SaveSpec("r", CHAIN.tenant, tuple(KEYS), (b"", KEYS[0], KEYS[1]), tuple(range(6)))
    saver.begin_step()
    for layer in range(2):  # as vLLM's forward: each layer's save after its attention
        saver.save_layer(layer, [spec])
    saver.finish_saves([spec])
    assert saver.settle() == set()
    assert saver.wait_idle(30)
    assert reg.get_sample_value("dscache_vllm_stored_blocks_total") == 3
    dst = kv(fill=False, device=device)
    loader, _ = worker(daemon, dst, copy_threads=copy_threads, layerwise=layerwise)
    assert loader.layerwise == (layerwise == "on")
    loader.begin_step()
    loader.start_loads([load_spec((9, 3, 4, 5, 14, 15))])  # pages need not be consecutive
    for layer in range(2):
        loader.wait_layer(layer)
        assert torch.equal(dst[layer][[9, 3, 4, 5, 14, 15]], src[layer][0:6])
    assert loader.settle() == set()
    saver.close()
    loader.close()


@pytest.mark.slow
def test_a_failed_load_drops_that_requests_saves_of_the_step(daemon: SidecarProcess) -> None:
    saver, _ = worker(daemon, kv(fill=True))
    save_all(saver)
    flip_block(saver.client, daemon.data_dir, CHAIN.tenant, KEYS[0])
    w, reg = worker(daemon, kv(fill=True))
    other = CHAIN.keys(list(range(9000, 9000 + 2 * BLOCK)))
    # One step: request r2 loads (block 0 is bad) and saves what its forward computed
    # from that prefix; request r3 saves blocks of its own.
    w.begin_step()
    w.start_loads([load_spec((10, 11, 12, 13, 14, 15))])
    saves = [
        SaveSpec("r2", CHAIN.tenant, (b"\x01" * 32,), (KEYS[2],), (6, 7)),
        SaveSpec("r3", CHAIN.tenant, tuple(other), (b"", other[0]), (0, 1, 2, 3)),
    ]
    w.finish_saves(saves)
    assert w.settle() == {10, 11, 12, 13, 14, 15}
    assert w.wait_idle(30)
    assert reg.get_sample_value("dscache_vllm_stored_blocks_total") == 2  # r3's only
    assert w.client.find(CHAIN.tenant, [b"\x01" * 32]).found == 0
    saver.close()
    w.close()


@pytest.mark.slow
def test_a_verified_block_is_not_hashed_again_until_its_segment_changes(
    daemon: SidecarProcess,
) -> None:
    saver, _ = worker(daemon, kv(fill=True))
    save_all(saver)
    time.sleep(1.2)  # the segment is quiet: a later write moves its mtime for sure
    loader, reg = worker(daemon, kv(fill=False))
    spec = load_spec((10, 11, 12, 13, 14, 15))
    assert loader.load(spec) == set()
    assert loader.checked_loads == 1
    assert loader.load(spec) == set()
    assert loader.checked_loads == 1  # remembered: mapped and copied, not hashed
    # Any write to the segment (here, a flipped byte) is a new stamp: hashed again,
    # and the bad block is caught.
    flip_block(saver.client, daemon.data_dir, CHAIN.tenant, KEYS[2])
    assert loader.load(spec) == {14, 15}
    assert loader.checked_loads == 2
    assert reg.get_sample_value("dscache_vllm_load_failures_total", {"reason": "corrupt"}) == 2
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
