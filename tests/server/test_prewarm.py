"""``dscache prewarm`` against several real model servers, each with its own real sidecar.

The pods of a track each keep their own KV store, and the router may send a
session to any of them: a prewarm must reach every pod. These tests run two
``dscache server`` runtimes (uvicorn, a small model) on two sidecar daemons,
as two pods of one track would be, and check per-pod results.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from dscache_router.ring import Ring
from dscache_server.prewarm import PrewarmOptions, address, parse_targets, prewarm
from dscache_server.tokenizer import DeepSeekTokenizer
from srv_helpers import (
    BLOCK_TOKENS,
    LiveServer,
    SidecarDaemon,
    free_port,
    make_runtime,
    random_text,
    read_chats,
)

from dscache.cli import main


@pytest.fixture(scope="module")
def pods(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: DeepSeekTokenizer
) -> Iterator[list[LiveServer]]:
    sidecars = [SidecarDaemon(tmp_path_factory.mktemp(f"pod{i}") / "data") for i in range(2)]
    servers: list[LiveServer] = []
    try:
        for s in sidecars:
            s.start()
        servers = [LiveServer(make_runtime(s, tokenizer)) for s in sidecars]
        yield servers
    finally:
        for srv in servers:
            srv.stop()
        for s in sidecars:
            s.stop()


def _cached_tokens(srv: LiveServer, prompts: Path) -> int:
    """What a second pass finds cached on ``srv`` (after its background stores finished)."""
    assert srv.runtime.cache.wait_stored(30)
    again = prewarm(srv.url, read_chats(prompts), progress=False)
    assert again.failed == 0
    return again.cached_tokens


@pytest.mark.slow
def test_every_prompt_reaches_every_target(
    pods: list[LiveServer], prompts_file: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = pods
    prompts = prompts_file(seed=300)
    rc = main(
        ["prewarm", "--target", f"{a.url},{b.url}", "--prompts", str(prompts)]
        + ["--concurrency", "2", "--quiet"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    for srv in pods:
        assert f"prewarm {srv.url}: 3 sent, 0 failed" in out, out
        # Each pod's own store holds every prompt's full blocks now.
        assert _cached_tokens(srv, prompts) >= 3 * 64


@pytest.mark.slow
def test_repeated_targets_and_top_n(
    pods: list[LiveServer], prompts_file: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = pods
    prompts = prompts_file(seed=400)
    args = ["prewarm", "--target", a.url, "--target", f"{b.url}/", "--target", a.url]
    assert main([*args, "--prompts", str(prompts), "--top-n", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    # Duplicates collapse; each target got the first prompt only.
    assert out.count("prewarm http://") == 2
    assert f"prewarm {a.url}: 1 sent" in out and f"prewarm {b.url}: 1 sent" in out


@pytest.mark.slow
def test_a_target_that_takes_nothing_fails_the_run(
    pods: list[LiveServer], prompts_file: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = pods
    dead = f"http://127.0.0.1:{free_port()}"
    prompts = prompts_file(seed=500, n=2)
    rc = main(
        ["prewarm", "--target", f"{a.url},{dead}", "--prompts", str(prompts), "--quiet"]
        + ["--timeout", "5", "--connect-wait", "1"]
    )
    out = capsys.readouterr().out
    assert rc == 1, out  # a Job retries, then the rollout aborts with PrewarmFailed
    assert f"prewarm {a.url}: 2 sent, 0 failed" in out  # the live pod was still warmed
    assert f"prewarm {dead}: 0 sent, 2 failed" in out
    assert f"no prompt reached {dead}" in out


def _listen_late(delay_s: float, port: int, target: int) -> threading.Thread:
    """Refuses connections on ``port`` for ``delay_s`` (nothing listens: a new pod's
    address before the cluster's network policy admits the Job's pod), then relays
    one connection to ``target`` byte for byte."""

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def run() -> None:
        time.sleep(delay_s)
        with socket.create_server(("127.0.0.1", port)) as listener:
            listener.settimeout(30)
            conn, _ = listener.accept()
            with conn, socket.create_connection(("127.0.0.1", target)) as upstream:
                back = threading.Thread(target=pipe, args=(upstream, conn), daemon=True)
                back.start()
                pipe(conn, upstream)
                back.join(30)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_pod_that_refuses_connections_at_first_is_still_warmed(
    pods: list[LiveServer], prompts_file: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = pods
    port = free_port()
    relay = _listen_late(1.5, port, a.port)
    late = f"http://127.0.0.1:{port}"
    prompts = prompts_file(seed=550, n=1)
    rc = main(["prewarm", "--target", late, "--prompts", str(prompts), "--quiet"])
    out = capsys.readouterr().out
    # Before the retry on refused connections, this was "0 sent, 1 failed" and the
    # rollout was rolled back (PrewarmFailed) while the pod was fine.
    assert rc == 0 and f"prewarm {late}: 1 sent, 0 failed" in out, out
    relay.join(30)


def _cached_once(srv: LiveServer, chat: list[dict[str, object]]) -> int:
    """Cached tokens of one chat sent once more to ``srv`` (after its stores finished)."""
    assert srv.runtime.cache.wait_stored(30)
    r = prewarm(srv.url, [chat], progress=False)
    assert r.failed == 0
    return r.cached_tokens


@pytest.mark.slow
def test_ring_placement_warms_the_pods_the_router_tries_first_then_more_copies(
    pods: list[LiveServer], prompts_file: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = pods
    prompts = prompts_file(seed=600, n=8)
    chats = read_chats(prompts)
    ring = Ring([address(a.url), address(b.url)])
    first = {address(s.url): s for s in pods}
    # The router keys each id-less request by the bytes sent; the prewarm sends those bytes.
    walks = [ring.walk(PrewarmOptions().chat(c).key(4096, 2)) for c in chats]
    assert {w[0] for w in walks} == set(first)  # eight prompts do land on both pods
    args = ["prewarm", "--target", f"{a.url},{b.url}", "--prompts", str(prompts), "--quiet"]
    assert main([*args, "--placement", "ring"]) == 0
    out = capsys.readouterr().out
    for srv in pods:
        n = sum(1 for w in walks if w[0] == address(srv.url))
        assert f"prewarm {srv.url}: {n} sent, 0 failed" in out, out
    # Only the first pod of each prompt's walk holds it: one copy, not one per pod.
    i = next(i for i, w in enumerate(walks) if first[w[0]] is a)
    assert _cached_once(a, chats[i]) >= 64
    j = next(j for j, w in enumerate(walks) if first[w[0]] is b and j != i)
    assert _cached_once(a, chats[j]) == 0
    # The next step adds the second copy and skips the first.
    assert main([*args, "--placement", "ring", "--copies", "2", "--skip-copies", "1"]) == 0
    out = capsys.readouterr().out
    for srv in pods:
        n = sum(1 for w in walks if w[1] == address(srv.url))
        assert f"prewarm {srv.url}: {n} sent, 0 failed" in out, out
    assert _cached_once(b, chats[i]) >= 64  # i's second pod is b


def test_templates_mined_on_a_serving_pod_warm_a_new_pod(
    pods: list[LiveServer],
    live_server: Callable[..., LiveServer],
    tokenizer: DeepSeekTokenizer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    secret = "gw-secret-for-prewarm"
    serving = live_server(gateway_secret=secret)
    system = random_text(tokenizer, 160, seed=77)

    def ask(srv: LiveServer, question: str, session: str) -> int:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        r = httpx.post(
            srv.url + "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 1},
            headers={"X-Session-ID": session},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    for i, q in enumerate(["Alpha: what changed?", "Beta: who signed?", "Gamma: when?"]):
        ask(serving, q, f"live-{i}")
    new_pod = pods[0]
    args = ["prewarm", "--target", new_pod.url, "--mined-from", serving.url, "--quiet"]
    assert main(args) == 2  # the templates are read with the gateway token only
    monkeypatch.setenv("DSCACHE_PREWARM_GATEWAY_TOKEN", secret)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1 mined templates from 1 servers" in out, out
    assert f"prewarm {new_pod.url}: 1 sent, 0 failed" in out, out
    # A new conversation on the new pod starts with the mined prefix already cached.
    assert new_pod.runtime.cache.wait_stored(30)
    assert ask(new_pod, "Delta: any risks?", "new-0") >= 2 * BLOCK_TOKENS
    # A serving pod that cannot answer costs its templates, not the Job.
    dead = f"http://127.0.0.1:{free_port()}"
    rc = main(["prewarm", "--target", new_pod.url, "--mined-from", dead, "--quiet"])
    assert rc == 0
    assert "no mined templates" in capsys.readouterr().out


@pytest.mark.slow
def test_targets_are_checked() -> None:
    assert parse_targets(["http://a:1, http://b:2/", "http://a:1"]) == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="not an http"):
        parse_targets(["10.0.0.1:8000"])
    with pytest.raises(ValueError, match="no target"):
        parse_targets([" , "])
    assert main(["prewarm", "--target", "10.0.0.1:8000", "--prompts", "/nonexistent"]) == 2
    assert main(["prewarm", "--target", "http://127.0.0.1:1"]) == 2  # no prompts at all
    assert main(["prewarm", "--target", "http://127.0.0.1:1", "--mined-from", "http://x:1"]) == 2
    bad = ["prewarm", "--target", "http://127.0.0.1:1", "--prompts", "/nonexistent"]
    assert main([*bad, "--placement", "ring", "--copies", "0"]) == 2
    assert address("http://10.0.0.1:8000/") == "10.0.0.1:8000"
    assert address("http://[fd00::1]:8000") == "[fd00::1]:8000"
    assert address("https://pod.example") == "pod.example:443"
