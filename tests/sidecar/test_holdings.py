"""What a sidecar holds, as a router sees it: the holdings filter and its endpoint.

The filter's format (round trip, refusal of bytes that are not one, prefix
lengths, the false-positive rate it promises), then the real daemon publishing
it at ``GET /dscache/holdings``: what is stored shows up in a later generation,
what is deleted drops out of one, and an unchanged index is not rebuilt.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from dscache_sidecar.blockstore import Listing
from dscache_sidecar.config import add_sidecar_arguments, settings_from_args
from dscache_sidecar.holdings import (
    GENERATION_HEADER,
    HOLDINGS_PATH,
    INTERNAL_TOKEN_HEADER,
    KEYS_HEADER,
    HoldingsFilter,
    HoldingsFormatError,
)
from dscache_sidecar.holdings_publisher import Holdings, HoldingsPublisher
from dscache_sidecar.probes import ProbeServer, make_app
from prometheus_client import CollectorRegistry
from sidecar_helpers import REPO, Sidecar, blocks_for, chain, prompt, store_chain


def _keys(n: int, tag: str) -> list[bytes]:
    """``n`` distinct 32-byte keys, as block keys are (SHA-256 digests)."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


# ---------------------------------------------------------------------- the format


def test_a_filter_round_trips_through_its_bytes() -> None:
    present = _keys(5000, "present")
    original = HoldingsFilter.of(present, capacity=10_000)
    data = original.to_bytes()
    copy = HoldingsFilter.from_bytes(data)
    assert all(k in copy for k in present)
    assert copy.to_bytes() == data
    assert copy.size_bits == original.size_bits


def test_the_bytes_do_not_depend_on_the_process() -> None:
    """The router decodes in another process: the hash must not be Python's seeded one."""
    script = (
        "import hashlib, sys\n"
        "from dscache_sidecar.holdings import HoldingsFilter\n"
        "keys = [hashlib.sha256(f'present/{i}'.encode()).digest() for i in range(100)]\n"
        "sys.stdout.buffer.write(HoldingsFilter.of(keys, capacity=1024).to_bytes())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO / "sidecar")}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, check=True, timeout=60
    ).stdout
    assert out == HoldingsFilter.of(_keys(100, "present"), capacity=1024).to_bytes()


def _with_hashes(data: bytes, hashes: int) -> bytes:
    return data[:14] + struct.pack("<Q", hashes) + data[22:]


@pytest.mark.parametrize(
    ("mangle", "why"),
    [
        (lambda d: b"XXXX" + d[4:], "bad magic"),
        (lambda d: d[:4] + struct.pack("<H", 2) + d[6:], "version 2"),
        (lambda d: d[:-1], "expected"),  # one byte short: rbloom alone would accept it
        (lambda d: d + b"\0", "expected"),
        (lambda d: d[:14], "too short"),  # header only
        (lambda d: d[:5], "too short"),
        (lambda d: b"", "too short"),
        (lambda d: _with_hashes(d, 0), "hash functions"),  # rbloom: every key "held"
        (lambda d: _with_hashes(d, 1000), "hash functions"),
    ],
    ids=[
        "magic",
        "version",
        "truncated",
        "padded",
        "header-only",
        "stub",
        "empty",
        "no-hashes",
        "absurd-hashes",
    ],
)
def test_bytes_that_are_not_a_filter_are_refused(
    mangle: Callable[[bytes], bytes], why: str
) -> None:
    data = HoldingsFilter.of(_keys(10, "present"), capacity=1024).to_bytes()
    with pytest.raises(HoldingsFormatError, match=why):
        HoldingsFilter.from_bytes(mangle(data))


def test_prefix_length_stops_at_the_first_key_not_held() -> None:
    held = _keys(6, "held")
    absent = _keys(3, "absent")
    f = HoldingsFilter.of(held, capacity=1024)
    assert f.prefix_length(held) == 6
    assert f.prefix_length(held[:3] + absent[:1] + held[3:]) == 3  # a hole ends the prefix
    assert f.prefix_length(absent + held) == 0
    assert f.prefix_length([]) == 0
    assert "not bytes" not in f  # not a key, never held


def test_the_false_positive_rate_stays_near_its_target_at_capacity() -> None:
    present = _keys(5000, "present")
    f = HoldingsFilter.of(present, capacity=5000, false_positive_rate=0.01)
    assert all(k in f for k in present)  # no false negatives, ever
    absent = _keys(10_000, "absent")
    rate = sum(k in f for k in absent) / len(absent)
    assert rate < 0.03, rate


# ---------------------------------------------------------------------- the endpoint


def _fetch(
    port: int, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{HOLDINGS_PATH}", method=method, headers=headers or {}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _port(s: Sidecar) -> int:
    assert s.running is not None and s.running.metrics_port is not None
    return s.running.metrics_port


def _published_when(
    port: int, ok: Callable[[HoldingsFilter], bool], after: int = 0, timeout_s: float = 20
) -> tuple[int, int, HoldingsFilter]:
    """Polls the endpoint until a generation past ``after`` satisfies ``ok``:
    (generation, keys, filter)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, headers, body = _fetch(port)
        if status == 200:
            generation = int(headers[GENERATION_HEADER])
            f = HoldingsFilter.from_bytes(body)
            if generation > after and ok(f):
                return generation, int(headers[KEYS_HEADER]), f
        assert time.monotonic() < deadline, f"not published in {timeout_s}s: {status} {body!r}"
        time.sleep(0.02)


def test_the_sidecar_publishes_what_it_holds_and_drops_what_it_deleted(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    s = make_sidecar(holdings_refresh_s=0.05)
    port = _port(s)
    tenant, keys = store_chain(s.c, 8, seed=1)
    others = [os.urandom(32) for _ in range(20)]

    gen, count, f = _published_when(port, lambda f: f.prefix_length(keys) == 8)
    assert count == 8
    status, headers, _ = _fetch(port)
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    assert not any(k in f for k in others)

    # Deleting block 4 removes it and its descendants: a later generation drops them.
    assert s.c.delete(tenant, [keys[4]]) == 4
    later, count, f = _published_when(port, lambda f: keys[4] not in f, after=gen)
    assert count == 4 and f.prefix_length(keys) == 4
    assert not any(k in f for k in keys[4:])

    body = _fetch(port)[2]
    assert s.metric("dscache_sidecar_holdings_keys") == 4
    assert s.metric("dscache_sidecar_holdings_bytes") == len(body)
    assert s.metric("dscache_sidecar_holdings_build_seconds_count") >= later


def test_a_reader_holding_the_current_build_gets_304_without_a_body(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    s = make_sidecar(holdings_refresh_s=3600)  # builds at start, then on refresh()
    assert s.running is not None and s.running.holdings is not None
    port = _port(s)
    _published_when(port, lambda f: True)
    status, headers, body = _fetch(port)
    etag = headers["ETag"]
    assert status == 200 and body and etag.startswith('"') and etag.endswith('"')
    status, again, body = _fetch(port, headers={"If-None-Match": etag})
    assert (status, body, again["ETag"]) == (304, b"", etag)
    store_chain(s.c, 2, seed=9)
    assert s.running.holdings.refresh()
    status, headers, body = _fetch(port, headers={"If-None-Match": etag})
    assert status == 200 and headers["ETag"] != etag
    assert HoldingsFilter.from_bytes(body)  # the new build, whole


@pytest.mark.slow
def test_with_an_internal_token_only_its_bearer_reads_the_filter(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    s = make_sidecar(holdings_refresh_s=0.05, internal_token="picker-token-1")
    port = _port(s)
    store_chain(s.c, 3, seed=4)
    # Whoever reaches the port without the token learns nothing of what is held ...
    for headers in ({}, {INTERNAL_TOKEN_HEADER: "a guess"}, {INTERNAL_TOKEN_HEADER: ""}):
        status, _, body = _fetch(port, headers=headers)
        assert status == 401 and INTERNAL_TOKEN_HEADER.encode() in body
    # ... the picker, with it, gets the filter; metrics and probes need no token.
    deadline = time.monotonic() + 20
    while True:
        status, headers, body = _fetch(port, headers={INTERNAL_TOKEN_HEADER: "picker-token-1"})
        if status == 200 and headers[KEYS_HEADER] == "3":
            break
        assert time.monotonic() < deadline, (status, body)
        time.sleep(0.05)
    for path in ("/metrics", "/healthz", "/readyz"):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            assert r.status == 200


def test_every_tenant_is_published(make_sidecar: Callable[..., Sidecar]) -> None:
    s = make_sidecar(holdings_refresh_s=0.05)
    a, b = chain("tenant-a"), chain("tenant-b")
    keys_a, keys_b = a.keys(prompt(2, seed=3)), b.keys(prompt(2, seed=4))
    assert s.c.store(a.tenant, blocks_for(keys_a)) == 2
    assert s.c.store(b.tenant, blocks_for(keys_b)) == 2
    _, count, _ = _published_when(
        _port(s), lambda f: f.prefix_length(keys_a) == 2 and f.prefix_length(keys_b) == 2
    )
    assert count == 4


def test_an_unchanged_index_is_not_rebuilt(make_sidecar: Callable[..., Sidecar]) -> None:
    s = make_sidecar(holdings_refresh_s=3600)  # the thread builds once, at start
    assert s.running is not None and s.running.holdings is not None
    publisher = s.running.holdings
    first, _, _ = _published_when(_port(s), lambda f: True)
    assert not publisher.refresh()
    _, keys = store_chain(s.c, 3, seed=2)
    assert publisher.refresh()
    assert not publisher.refresh()
    built = publisher.current()
    assert built is not None and built.generation == first + 1 and built.keys == 3
    assert HoldingsFilter.from_bytes(built.body).prefix_length(keys) == 3


def test_a_capped_filter_holds_the_first_keys_and_says_so(
    make_sidecar: Callable[..., Sidecar], caplog: pytest.LogCaptureFixture
) -> None:
    s = make_sidecar(holdings_refresh_s=0)
    assert s.running is not None
    _, keys = store_chain(s.c, 8, seed=5)
    store = s.running.store
    assert isinstance(store, Listing)
    publisher = HoldingsPublisher(store, 1.0, s.running.metrics, max_keys=3)
    with caplog.at_level(logging.WARNING, logger="dscache_sidecar.holdings_publisher"):
        assert publisher.refresh()
    built = publisher.current()
    assert built is not None and built.keys == 3
    f = HoldingsFilter.from_bytes(built.body)
    assert [k in f for k in sorted(keys)] == [True] * 3 + [False] * 5
    assert "only the first 3 are published" in caplog.text


def test_the_endpoint_is_404_when_off_and_405_for_other_methods(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    off = make_sidecar(holdings_refresh_s=0)
    assert off.running is not None and off.running.holdings is None
    status, _, body = _fetch(_port(off))
    assert status == 404 and b"not published" in body
    on = make_sidecar(holdings_refresh_s=0.05)
    status, headers, _ = _fetch(_port(on), "POST")
    assert status == 405 and headers["Allow"] == "GET"


def test_the_endpoint_is_503_before_the_first_build() -> None:
    built: list[Holdings] = []
    app = make_app(
        CollectorRegistry(),
        live=lambda: "SERVING",
        ready=lambda: "SERVING",
        holdings=lambda: built[-1] if built else None,
    )
    http = ProbeServer("127.0.0.1", 0, app)
    try:
        assert _fetch(http.port)[0] == 503
        body = HoldingsFilter.of(_keys(2, "held"), capacity=1024).to_bytes()
        built.append(Holdings(generation=1, keys=2, body=body))
        status, headers, got = _fetch(http.port)
        assert (status, got) == (200, body)
        assert headers[KEYS_HEADER] == "2" and headers[GENERATION_HEADER] == "1"
    finally:
        http.close()


def test_the_refresh_flag_sets_the_setting(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    add_sidecar_arguments(p)
    args = p.parse_args(["--data-dir", str(tmp_path), "--holdings-refresh", "0"])
    assert settings_from_args(args).holdings_refresh_s == 0
    args = p.parse_args(["--data-dir", str(tmp_path)])
    assert settings_from_args(args).holdings_refresh_s == 2.0
