"""``dscache prewarm`` against several real model servers, each with its own real sidecar.

The pods of a track each keep their own KV store, and the router may send a
session to any of them: a prewarm must reach every pod. These tests run two
``dscache server`` runtimes (uvicorn, a small model) on two sidecar daemons,
as two pods of one track would be, and check per-pod results.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dscache_server.prewarm import parse_targets, prewarm
from dscache_server.tokenizer import DeepSeekTokenizer
from srv_helpers import LiveServer, SidecarDaemon, free_port, make_runtime, read_chats

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


def test_a_target_that_takes_nothing_fails_the_run(
    pods: list[LiveServer], prompts_file: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = pods
    dead = f"http://127.0.0.1:{free_port()}"
    prompts = prompts_file(seed=500, n=2)
    rc = main(
        ["prewarm", "--target", f"{a.url},{dead}", "--prompts", str(prompts), "--quiet"]
        + ["--timeout", "5"]
    )
    out = capsys.readouterr().out
    assert rc == 1, out  # a Job retries, then the rollout aborts with PrewarmFailed
    assert f"prewarm {a.url}: 2 sent, 0 failed" in out  # the live pod was still warmed
    assert f"prewarm {dead}: 0 sent, 2 failed" in out
    assert f"no prompt reached {dead}" in out


def test_targets_are_checked() -> None:
    assert parse_targets(["http://a:1, http://b:2/", "http://a:1"]) == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="not an http"):
        parse_targets(["10.0.0.1:8000"])
    with pytest.raises(ValueError, match="no target"):
        parse_targets([" , "])
    assert main(["prewarm", "--target", "10.0.0.1:8000", "--prompts", "/nonexistent"]) == 2
