"""Fault injection (the chaos tests' lever): ``/debug/fault`` slows calls down and makes
block writes fail as on a full disk; off by default, where the path is 404.

Real daemons (a subprocess for the flag, in-process to read metrics), real gRPC, real HTTP.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from dscache_sidecar.client import SidecarClient, SidecarFullError, SidecarUnavailableError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sidecar_helpers import DaemonProcess, Sidecar, block_array, blocks_for, chain, prompt


def _http(port: int, method: str, body: bytes | None = None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/debug/fault", data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _put(port: int, faults: dict[str, object]) -> dict[str, object]:
    status, body = _http(port, "PUT", json.dumps(faults).encode())
    assert status == 200, body
    out: dict[str, object] = json.loads(body)
    return out


def _port(s: Sidecar) -> int:
    assert s.running is not None and s.running.metrics_port is not None
    return s.running.metrics_port


def test_delay_slows_every_kvcache_call_but_not_health(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(None, "--fault-injection")
    d.start()
    port = d.http_port
    assert json.loads(_http(port, "GET")[1]) == {"delay_s": 0.0, "enospc": False}
    ch = chain()
    keys = ch.keys(prompt(2, 1))
    with SidecarClient(d.socket, data_dir=str(d.data_dir), timeout_s=5) as c:
        assert c.store(ch.tenant, blocks_for(keys)) == 2
        assert _put(port, {"delay_s": 1.0}) == {"delay_s": 1.0, "enospc": False}
        assert json.loads(_http(port, "GET")[1])["delay_s"] == 1.0
        start = time.monotonic()
        with c.load(ch.tenant, keys) as loaded:
            assert len(loaded) == 2
        assert time.monotonic() - start >= 1.0
        # A lookup reads the index in this process: a slow daemon does not slow it.
        start = time.monotonic()
        answer = c.find(ch.tenant, keys)
        assert answer.found == 2 and answer.direct
        assert time.monotonic() - start < 1.0  # less than the daemon's injected delay
        # A caller with a shorter deadline gives up: the daemon is "slow".
        with (
            SidecarClient(d.socket, timeout_s=0.3) as impatient,
            pytest.raises(SidecarUnavailableError, match="DEADLINE_EXCEEDED"),
        ):
            impatient.lookup(ch.tenant, keys)
        # The health service is never delayed: kubelet probes do not flap.
        with grpc.insecure_channel(f"unix:{d.socket}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="dscache.v1.KVCache"), timeout=0.9
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # An empty body clears every fault.
        assert _put(port, {}) == {"delay_s": 0.0, "enospc": False}
        with SidecarClient(d.socket, timeout_s=0.9) as quick:
            assert quick.lookup(ch.tenant, keys) == 2
    assert d.terminate() == 0


def _assert_reads(c: SidecarClient, tenant: str, keys: list[bytes]) -> None:
    with c.load(tenant, keys) as got:
        assert got.keys == keys
        for key, arr in zip(got.keys, got.arrays, strict=True):
            np.testing.assert_array_equal(arr, block_array(key))


@pytest.mark.slow
@pytest.mark.parametrize("shared_volume", [True, False], ids=["allocate-commit", "put"])
def test_enospc_fails_writes_as_a_full_disk_and_reads_go_on(
    make_sidecar: Callable[..., Sidecar], shared_volume: bool
) -> None:
    s = make_sidecar(fault_injection=True)
    c = s.c if shared_volume else SidecarClient(s.running.socket_path)  # type: ignore[union-attr]
    ch = chain()
    kept = ch.keys(prompt(4, 1))
    assert c.store(ch.tenant, blocks_for(kept)) == 4
    used_before = c.stats().used_bytes
    _put(_port(s), {"enospc": True})
    for seed in range(10, 15):
        with pytest.raises(SidecarFullError, match="RESOURCE_EXHAUSTED"):
            c.store(ch.tenant, blocks_for(ch.keys(prompt(2, seed))))
        _assert_reads(s.c, ch.tenant, kept)
    # The refused writes published nothing and leaked no space.
    assert c.lookup(ch.tenant, ch.keys(prompt(2, 10))) == 0
    assert c.stats().used_bytes == used_before
    assert s.metric("dscache_sidecar_write_rejections_total", reason="disk_full") >= 5
    assert s.metric("dscache_sidecar_rpc_errors_total", op="Commit", code="INTERNAL") == 0
    assert s.metric("dscache_sidecar_rpc_errors_total", op="Put", code="INTERNAL") == 0
    assert c.healthy()
    # The "disk" has room again: writes work.
    _put(_port(s), {"enospc": False})
    fresh = ch.keys(prompt(2, 99))
    assert c.store(ch.tenant, blocks_for(fresh)) == 2
    _assert_reads(s.c, ch.tenant, fresh)
    if not shared_volume:
        c.close()


@pytest.mark.parametrize(
    "body",
    [
        b'{"delay_s": -1}',
        b'{"delay_s": "slow"}',
        b'{"enospc": "yes"}',
        b'{"delay": 1}',
        b"[1, 2]",
        b"not json",
        b"",
    ],
)
def test_a_bad_fault_body_is_400_and_changes_nothing(
    make_sidecar: Callable[..., Sidecar], body: bytes
) -> None:
    s = make_sidecar(fault_injection=True)
    _put(_port(s), {"delay_s": 0.25, "enospc": True})
    status, text = _http(_port(s), "PUT", body)
    assert status == 400 and "invalid fault body" in text
    assert json.loads(_http(_port(s), "GET")[1]) == {"delay_s": 0.25, "enospc": True}
    assert _http(_port(s), "POST", b"{}")[0] == 405


def test_fault_injection_is_off_by_default(make_sidecar: Callable[..., Sidecar]) -> None:
    s = make_sidecar()
    assert _http(_port(s), "GET")[0] == 404
    assert _http(_port(s), "PUT", b'{"enospc": true}')[0] == 404
    ch = chain()
    keys = ch.keys(prompt(2, 3))
    assert s.c.store(ch.tenant, blocks_for(keys)) == 2  # the PUT above did nothing
    _assert_reads(s.c, ch.tenant, keys)
