"""Helpers of the model-server tests (imported by conftest.py and the tests).

A module with a unique name: ``conftest`` is a name every test folder has.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
from dscache_server.app import create_app
from dscache_server.config import ServerSettings
from dscache_server.engine import TransformersEngine
from dscache_server.loading import load_engine
from dscache_server.metrics import ServerMetrics
from dscache_server.runtime import Runtime, build_runtime
from dscache_server.tokenizer import DeepSeekTokenizer
from dscache_tools.net import free_port
from dscache_tools.sidecarproc import SidecarProcess
from tenacity import Retrying, retry_if_not_result, stop_after_delay, wait_fixed

REPO = Path(__file__).resolve().parents[2]
BLOCK_TOKENS = 32
MIN_CACHE_TOKENS = 64


class SidecarDaemon(SidecarProcess):
    """The server tests' sidecar: 512 MiB in 64 MiB segments."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir, "--capacity", "512MiB", "--segment-size", "64MiB")


_ENGINES: dict[tuple[str, int, str], TransformersEngine] = {}


def engine_for(
    preset: str, block_tokens: int = BLOCK_TOKENS, dtype: str = "float32"
) -> TransformersEngine:
    """A session-wide engine per (preset, block size, dtype); building one takes seconds."""
    key = (preset, block_tokens, dtype)
    if key not in _ENGINES:
        _ENGINES[key] = load_engine(
            preset, seed=0, block_tokens=block_tokens, threads=1, dtype=dtype
        )
    return _ENGINES[key]


def server_settings(sidecar: SidecarDaemon | None, **kw: Any) -> ServerSettings:
    base: dict[str, Any] = {
        "model": "mini-gqa",
        "block_tokens": BLOCK_TOKENS,
        "min_cache_tokens": MIN_CACHE_TOKENS,
        "calibrate": False,
        # The model stays as configured: live timings of the tiny test models must not
        # turn admission off in the middle of a test about something else.
        "admission_refit_s": 0.0,
        "circuit_cooldown_s": 0.2,
        "sidecar_timeout_s": 1.0,
        "default_max_tokens": 8,
    }
    if sidecar is not None:
        base["sidecar_socket"] = sidecar.socket
        base["sidecar_data_dir"] = str(sidecar.data_dir)
    base.update(kw)
    return ServerSettings(**base)


def make_runtime(sidecar: SidecarDaemon | None, tokenizer: DeepSeekTokenizer, **kw: Any) -> Runtime:
    settings = server_settings(sidecar, **kw)
    engine = engine_for(settings.model, settings.block_tokens, settings.dtype)
    return build_runtime(settings, ServerMetrics(), engine=engine, tokenizer=tokenizer)


class LiveServer:
    """uvicorn serving one runtime in a background thread."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(runtime), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        poll = Retrying(
            stop=stop_after_delay(30),
            wait=wait_fixed(0.05),
            retry=retry_if_not_result(bool),
            retry_error_callback=lambda _state: False,
        )
        if not poll(lambda: self.server.started):
            raise RuntimeError("server did not start")

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples ``name`` whose labels include ``labels`` (as ``sum()``)."""
        return sum(
            s.value
            for family in self.runtime.metrics.registry.collect()
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def label_values(self, name: str, label: str) -> set[str]:
        """The values ``label`` takes in the samples ``name``."""
        return {
            s.labels[label]
            for family in self.runtime.metrics.registry.collect()
            for s in family.samples
            if s.name == name and label in s.labels
        }

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.runtime.close()


def random_text(tokenizer: DeepSeekTokenizer, min_tokens: int, seed: int) -> str:
    """Words that tokenize to at least ``min_tokens`` tokens."""
    rng = np.random.default_rng(seed)
    words = ["market", "risk", "bond", "yield", "equity", "credit", "rate", "fund", "asset"]
    text = ""
    while len(tokenizer.encode(text)) < min_tokens:
        text += " ".join(
            str(rng.choice(words)) + str(int(rng.integers(0, 1000))) for _ in range(32)
        )
        text += ". "
    return text


def write_prompts(path: Path, tokenizer: DeepSeekTokenizer, seed: int, n: int) -> Path:
    """A prewarm prompts file: ``n`` one-message chats of >= 80 tokens (seeds ``seed``...)."""
    chats = [
        {"messages": [{"role": "user", "content": random_text(tokenizer, 80, seed=seed + i)}]}
        for i in range(n)
    ]
    path.write_text("\n".join(json.dumps(c) for c in chats) + "\n")
    return path


def read_chats(path: Path) -> list[list[dict[str, Any]]]:
    """The chats of a prompts file, as ``prewarm`` takes them."""
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()]
