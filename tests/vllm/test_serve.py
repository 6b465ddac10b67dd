"""``dscache vllm serve``: vLLM's OpenAI server with the connector, restarted warm."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from dscache_sidecar.client import SidecarClient
from dscache_tools.net import free_port
from dscache_tools.polling import wait_until
from dscache_tools.sidecarproc import SidecarProcess
from dscache_tools.vllmprobe import vllm_python
from vllm_helpers import STORE_FLAGS

pytestmark = pytest.mark.vllm

#: A long system prompt (reusable across restarts) and a question.
MESSAGES = [
    {"role": "system", "content": "You answer questions about filings. " * 120},
    {"role": "user", "content": "How did the margins change over three years?"},
]


class Server:
    """``dscache vllm serve`` as a child process."""

    def __init__(self, model: Path, sidecar: SidecarProcess, log: Path) -> None:
        self.port = free_port()
        dscache = vllm_python().with_name("dscache")
        cmd = [
            str(dscache), "vllm", "serve",
            "--socket", sidecar.socket, "--data-dir", str(sidecar.data_dir),
            str(model),
            "--port", str(self.port), "--host", "127.0.0.1",
            "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager",
            "--gpu-memory-utilization", "0.1", "--block-size", "128",
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
        ]  # fmt: skip
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.log = log.open("a")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until("vllm serve's /health", self._healthy, timeout=300, interval=1)

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; see the log")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def chat(self) -> dict[str, object]:
        body = {"model": self.model_name(), "messages": MESSAGES, "max_tokens": 8}
        resp = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=120)
        resp.raise_for_status()
        out: dict[str, object] = resp.json()
        return out

    def model_name(self) -> str:
        models = httpx.get(f"{self.url}/v1/models", timeout=10).json()
        return str(models["data"][0]["id"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    proc = SidecarProcess(tmp_path / "store", *STORE_FLAGS)
    proc.start()
    yield proc
    proc.stop()


def test_a_restarted_vllm_server_answers_from_the_stored_prefix(
    vllm_model: Path, sidecar: SidecarProcess, tmp_path: Path
) -> None:
    first = Server(vllm_model, sidecar, tmp_path / "serve.log")
    try:
        cold = first.chat()
        with SidecarClient(sidecar.socket) as client:
            wait_until("the prefix stored", lambda: client.stats().blocks >= 2, timeout=60)
    finally:
        first.stop()
    second = Server(vllm_model, sidecar, tmp_path / "serve.log")
    try:
        warm = second.chat()
    finally:
        second.stop()
    # vLLM's own prefix cache is off and the process is new: cached tokens came
    # from dscache (the system prompt's whole blocks).
    assert cached(cold) == 0
    assert cached(warm) >= 512
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]  # type: ignore[index]


def cached(answer: dict[str, object]) -> int:
    details = answer["usage"]["prompt_tokens_details"]  # type: ignore[index]
    return int(details["cached_tokens"]) if details else 0
