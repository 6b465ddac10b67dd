"""Fixtures for model-server tests: the real sidecar daemon as a subprocess on a
temp dir, real engines built from presets (cached per session: building one takes
seconds), and the real HTTP server (uvicorn in a thread) on a free port.

Small blocks (32 tokens) and a low cache threshold keep prompts short, so the
whole folder stays cheap on CPU; the big figures belong to ``dscache bench ttft``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dscache_server.tokenizer import DeepSeekTokenizer
from factories import stopped_after
from srv_helpers import LiveServer, SidecarDaemon, make_runtime, write_prompts


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarDaemon]:
    """One real sidecar daemon per test module."""
    daemon = SidecarDaemon(tmp_path_factory.mktemp("sidecar") / "data")
    daemon.start()
    yield daemon
    daemon.stop()


@pytest.fixture(scope="session")
def tokenizer() -> DeepSeekTokenizer:
    return DeepSeekTokenizer()


@pytest.fixture
def live_server(
    sidecar: SidecarDaemon, tokenizer: DeepSeekTokenizer
) -> Iterator[Callable[..., LiveServer]]:
    """Factory of running servers on the module's sidecar; stopped at the end."""
    with stopped_after(lambda **kw: LiveServer(make_runtime(sidecar, tokenizer, **kw))) as make:
        yield make


@pytest.fixture(scope="module")
def live_server_module(
    sidecar: SidecarDaemon, tokenizer: DeepSeekTokenizer
) -> Iterator[Callable[..., LiveServer]]:
    """As ``live_server``, for servers shared by a module's tests (hypothesis examples)."""
    with stopped_after(lambda **kw: LiveServer(make_runtime(sidecar, tokenizer, **kw))) as make:
        yield make


@pytest.fixture
def prompts_file(tmp_path: Path, tokenizer: DeepSeekTokenizer) -> Callable[..., Path]:
    """Factory ``(seed, n=3) -> path`` of a ``dscache prewarm`` prompts file."""

    def write(seed: int, n: int = 3) -> Path:
        return write_prompts(tmp_path / f"prompts-{seed}.jsonl", tokenizer, seed, n)

    return write
