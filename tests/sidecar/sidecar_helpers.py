"""Helpers for sidecar tests (imported by name: a module called conftest would clash
with other test folders' conftest files): the real daemon (in-process or as a subprocess),
real gRPC over a unix socket, real LMDB and segment files in a temp dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from dscache_sidecar.client import BlockData, SidecarClient
from dscache_sidecar.config import SidecarSettings
from dscache_sidecar.daemon import RunningSidecar, create_server
from dscache_sidecar.metrics import SidecarMetrics
from dscache_tools.sidecarproc import SidecarProcess

from dscache.keys import KeyChain, KVLayout, LayoutKind, ModelFingerprint, tenant_salt

BLOCK_TOKENS = 16
LAYOUT = KVLayout(
    LayoutKind.GQA, num_layers=2, dtype="float32", num_kv_heads=2, head_dim=8, v_head_dim=8
)
BLOCK_SHAPE = (2, 2, 2, BLOCK_TOKENS, 8)  # 4 KiB per block
REPO = Path(__file__).resolve().parents[2]


def chain(tenant: str = "tenant-a", model: str = "m") -> KeyChain:
    fp = ModelFingerprint(model, "rev", LAYOUT, block_tokens=BLOCK_TOKENS)
    return KeyChain(fp, tenant_salt(tenant))


def block_array(key: bytes, shape: tuple[int, ...] = BLOCK_SHAPE) -> np.ndarray:
    """Deterministic content per key, so any reader can check what it got."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.standard_normal(shape, dtype=np.float32)


def blocks_for(keys: list[bytes], shape: tuple[int, ...] = BLOCK_SHAPE) -> list[BlockData]:
    return [
        BlockData(k, keys[i - 1] if i else b"", block_array(k, shape)) for i, k in enumerate(keys)
    ]


def prompt(n_blocks: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 100_000, size=n_blocks * BLOCK_TOKENS)]


def store_chain(client: SidecarClient, n_blocks: int, seed: int) -> tuple[str, list[bytes]]:
    """Stores a new chain of ``n_blocks`` for the default tenant: (tenant, keys)."""
    ch = chain()
    keys = ch.keys(prompt(n_blocks, seed))
    assert client.store(ch.tenant, blocks_for(keys)) == n_blocks
    return ch.tenant, keys


def settings(tmp: Path, **kw: Any) -> SidecarSettings:
    base: dict[str, Any] = {
        "data_dir": tmp,
        "capacity_bytes": 1024 * 1024,
        "segment_bytes": 256 * 1024,
        "metrics_port": 0,
        "metrics_host": "127.0.0.1",
        "restart_quarantine_s": 0,
    }
    base.update(kw)
    return SidecarSettings(**base)


#: The helper client's deadline for lookups and leases (writes get 20x).
CLIENT_TIMEOUT_S = 5.0


class Sidecar:
    """An in-process daemon plus a client with the shared volume."""

    def __init__(self, data_dir: Path, **kw: Any) -> None:
        self.data_dir = data_dir
        self.kw = kw
        self.running: RunningSidecar | None = None
        self.client: SidecarClient | None = None
        self.start()

    def start(self) -> None:
        self.running = create_server(settings(self.data_dir, **self.kw), SidecarMetrics())
        # A generous deadline: the daemon runs in this process (one GIL with the test's
        # threads) and a lookup may wait on the shared tier; these tests check what is
        # found, not how fast (the deadline tests make clients of their own).
        self.client = SidecarClient(
            self.running.socket_path, data_dir=str(self.data_dir), timeout_s=CLIENT_TIMEOUT_S
        )

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.running is not None:
            self.running.stop(grace_s=1)
        self.client, self.running = None, None

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def c(self) -> SidecarClient:
        assert self.client is not None
        return self.client

    @property
    def store(self) -> Any:
        assert self.running is not None
        return self.running.store

    def metric(self, name: str, **labels: str) -> float:
        assert self.running is not None
        value = self.running.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


class DaemonProcess(SidecarProcess):
    """``dscache sidecar`` as a real subprocess (for kill -9 and disk tests).

    64 MiB in 16 MiB segments unless the test's flags say otherwise (they come later
    on the command line and win): the default 4 GiB is zero-filled on disk, and a
    suite of such daemons left tens of GiB in pytest's kept temp dirs.
    """

    def __init__(self, data_dir: Path, *extra: str) -> None:
        super().__init__(data_dir, "--capacity", "64MiB", "--segment-size", "16MiB", *extra)

    def start(self, timeout: float = 30) -> None:
        super().start(timeout)
