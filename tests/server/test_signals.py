"""Serving-path signals: the model server tells the sidecar's eviction policy what it knows.

A real sidecar (its own process, the ``chain`` policy) and the real HTTP server: the
next-turn header becomes a signal once the prompt's blocks are stored, a request that
waits for a slot tells the sidecar its prefix is queued, and a bad header is a 400.
Every test starts processes, so each is marked slow.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from typing import cast

import httpx
import pytest
from dscache_server.tokenizer import DeepSeekTokenizer
from dscache_tools.sidecarproc import SidecarProcess
from factories import stopped_after
from srv_helpers import LiveServer, SidecarDaemon, make_runtime, random_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chain_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    daemon = SidecarProcess(
        tmp_path_factory.mktemp("chain") / "data",
        "--capacity", "64MiB", "--segment-size", "16MiB", "--policy", "chain",
    )  # fmt: skip
    daemon.start()
    yield daemon
    daemon.stop()


@pytest.fixture
def server(
    chain_sidecar: SidecarProcess, tokenizer: DeepSeekTokenizer
) -> Iterator[Callable[..., LiveServer]]:
    daemon = cast(SidecarDaemon, chain_sidecar)  # the same socket and data dir attributes
    with stopped_after(lambda **kw: LiveServer(make_runtime(daemon, tokenizer, **kw))) as make:
        yield make


def sidecar_metric(sidecar: SidecarProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{sidecar.http_port}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def chat(tokenizer: DeepSeekTokenizer, seed: int) -> dict[str, object]:
    return {
        "messages": [{"role": "user", "content": random_text(tokenizer, 150, seed=seed)}],
        "max_tokens": 2,
    }


def test_next_turn_header_reaches_the_sidecar_policy(
    server: Callable[..., LiveServer], chain_sidecar: SidecarProcess, tokenizer: DeepSeekTokenizer
) -> None:
    srv = server()
    url = srv.url + "/v1/chat/completions"
    before = sidecar_metric(chain_sidecar, "dscache_sidecar_signals_total", kind="ended")
    r = httpx.post(
        url, json=chat(tokenizer, 1), headers={"X-Dscache-Next-Turn": "ended"}, timeout=60
    )
    assert r.status_code == 200
    r = httpx.post(
        url, json=chat(tokenizer, 2), headers={"X-Dscache-Next-Turn": "Expected"}, timeout=60
    )
    assert r.status_code == 200
    assert srv.runtime.cache.wait_stored(30)
    assert srv.metric("dscache_server_cache_signals_total", kind="ended", result="sent") == 1
    assert srv.metric("dscache_server_cache_signals_total", kind="expected", result="sent") == 1
    # The signal came after the blocks were stored: the policy marked them.
    marked = sidecar_metric(
        chain_sidecar, "dscache_sidecar_signals_total", kind="ended", result="marked"
    )
    assert marked - before == 1


def test_a_bad_next_turn_header_is_refused_before_any_work(
    server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    srv = server()
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json=chat(tokenizer, 3),
        headers={"X-Dscache-Next-Turn": "tomorrow"},
        timeout=60,
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_next_turn"
    assert srv.metric("dscache_server_cache_signals_total") == 0


def test_a_request_that_waits_for_a_slot_marks_its_prefix_queued(
    server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    srv = server(max_concurrency=1, max_queue=4)
    url = srv.url + "/v1/chat/completions"
    body = chat(tokenizer, 4)
    httpx.post(url, json=body, timeout=60).raise_for_status()  # its blocks are stored
    assert srv.runtime.cache.wait_stored(30)
    # Long enough that it still holds the slot when the second request arrives.
    holder = {**chat(tokenizer, 5), "stream": True, "max_tokens": 64}
    done = threading.Event()
    with httpx.stream("POST", url, json=holder, timeout=60) as stream:
        chunks = stream.iter_lines()
        next(chunks)  # the stream holds the only slot until it is read to the end

        def second() -> None:
            httpx.post(url, json=body, timeout=60).raise_for_status()
            done.set()

        t = threading.Thread(target=second)
        t.start()
        for _ in range(200):  # the second request is now waiting
            if srv.metric("dscache_server_cache_signals_total", kind="queued") >= 1:
                break
            done.wait(0.05)
        for _ in chunks:
            pass
    t.join(60)
    assert done.is_set()
    assert srv.metric("dscache_server_cache_signals_total", kind="queued", result="sent") == 1
