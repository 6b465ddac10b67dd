"""A vLLM engine in a child process (``python -m dscache_vllm.probe``), from tests and benches.

vLLM pins its own torch and transformers, so it lives in an environment of its
own: :func:`vllm_python` finds that interpreter (``DSCACHE_VLLM_PYTHON``, else the
repository's ``.venv-vllm``, which ``scripts/setup-vllm.sh`` creates).

Contract: :class:`VllmProbe` starts the engine and waits for its ready line; each
call sends one command and returns its answer (raising ``RuntimeError`` on an
``error`` answer or when the child exits); :meth:`close` never leaves a child
behind. The child's whole output goes to ``log``. A probe gets a temporary
directory of its own (vLLM leaves ZeroMQ sockets and ``vllm_dist_*`` files in
``$TMPDIR``), removed when it stops; ``vllm serve`` does not yet: both of its
starts timed out with one in a loaded run, cause not found.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, TextIO

MARK = "@@probe "
_REPO = Path(__file__).resolve().parents[2]


def vllm_python() -> Path:
    """The interpreter of the vLLM environment.

    Raises:
        FileNotFoundError: there is none (run scripts/setup-vllm.sh).
    """
    env = os.environ.get("DSCACHE_VLLM_PYTHON")
    path = Path(env) if env else _REPO / ".venv-vllm" / "bin" / "python"
    if not path.exists():
        raise FileNotFoundError(
            f"no vLLM environment at {path}: run `bash scripts/setup-vllm.sh` "
            "(or point DSCACHE_VLLM_PYTHON at a python with dscache[vllm])"
        )
    return path


def _scratch() -> Path:
    """A fresh temporary directory for one child (a short path: the Unix sockets vLLM
    makes in it must stay under 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix="vllm-"))


class VllmProbe:
    """One engine process.

    Args:
        config: the probe's configure command (model, connector, extra, ...).
        log: file that receives the child's output.
        timeout_s: how long start-up and each command may take.
    """

    def __init__(self, config: dict[str, Any], log: Path, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self.log = log
        self._log: TextIO = log.open("a")
        self._scratch = _scratch()
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TMPDIR=str(self._scratch))
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.proc = subprocess.Popen(
            [str(vllm_python()), "-m", "dscache_vllm.probe"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ready = self._send(config)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._answers.put(json.loads(line[len(MARK) :]))
            else:
                self._log.write(line)
                self._log.flush()
        self._answers.put(None)

    def _send(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as exc:
            raise RuntimeError(f"the vLLM probe exited; see {self.log}") from exc
        try:
            answer = self._answers.get(timeout=self.timeout_s)
        except queue.Empty as exc:
            raise TimeoutError(f"the vLLM probe did not answer in {self.timeout_s} s") from exc
        if answer is None:
            raise RuntimeError(f"the vLLM probe exited; see {self.log}")
        if "error" in answer:
            raise RuntimeError(f"the vLLM probe failed: {answer['error']}")
        return answer

    def generate(
        self, prompts: list[dict[str, Any]], *, max_tokens: int = 1, logprobs: int = 0
    ) -> dict[str, Any]:
        """Greedy generation of every prompt (see ``dscache_vllm.probe``)."""
        return self._send(
            {"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "logprobs": logprobs}
        )

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Waits until the connector's queued saves are written."""
        return bool(self._send({"op": "flush", "timeout_s": timeout_s})["idle"])

    def memcpy(self, nbytes: int, repeat: int = 5) -> float:
        """Median seconds of one plain copy of ``nbytes`` in the engine's process."""
        return float(self._send({"op": "memcpy", "bytes": nbytes, "repeat": repeat})["seconds"])

    def metrics(self) -> dict[str, float]:
        """The connector's counters in the engine process."""
        return {k: float(v) for k, v in self._send({"op": "metrics"}).items()}

    def keys(self, token_ids: list[int], salt: str | None = None) -> tuple[str, list[bytes]]:
        """The sidecar tenant and block keys the connector uses for ``token_ids``."""
        answer = self._send({"op": "keys", "token_ids": token_ids, "salt": salt})
        return str(answer["tenant"]), [bytes.fromhex(k) for k in answer["keys"]]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"op": "quit"})
                self.proc.wait(timeout=60)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> VllmProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class VllmServer:
    """``dscache vllm serve`` (vLLM's OpenAI server with the connector) as a child process.

    Args:
        model: the checkpoint directory.
        log: file that receives the server's output.
        socket, data_dir: the sidecar (None: vLLM alone, ``vllm serve`` without the
            connector, for baselines).
        vllm_args: more ``vllm serve`` flags.
        timeout_s: how long start-up may take (generous: a loaded 2-core machine
            imports vLLM's API server in about 3 minutes).
    """

    def __init__(
        self,
        model: Path,
        log: Path,
        *,
        socket: str | None,
        data_dir: str | None,
        vllm_args: tuple[str, ...] = (),
        timeout_s: float = 600.0,
    ) -> None:
        import httpx

        from dscache_tools.net import free_port
        from dscache_tools.polling import wait_until
        from dscache_tools.procs import start_child

        self.port = free_port()
        python = vllm_python()
        serve_args = [
            str(model), "--port", str(self.port), "--host", "127.0.0.1",
            "--enforce-eager", "--gpu-memory-utilization", "0.1",
            "--enable-prompt-tokens-details", *vllm_args,
        ]  # fmt: skip
        if socket is not None:
            store = ["--socket", socket] + (["--data-dir", data_dir] if data_dir else [])
            cmd = [str(python.with_name("dscache")), "vllm", "serve", *store, *serve_args]
        else:
            cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", *serve_args]
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.child = start_child("vllm-serve", cmd, log, env=env)
        self.proc = self.child.proc
        self.url = f"http://127.0.0.1:{self.port}"
        self._httpx = httpx
        try:
            wait_until("vllm serve's /health", self._healthy, timeout=timeout_s, interval=1)
        except BaseException:
            self.stop()
            raise
        self.model = str(httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"])

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; see its log")
        try:
            return bool(self._httpx.get(f"{self.url}/health", timeout=2).status_code == 200)
        except self._httpx.HTTPError:
            return False

    def metric(self, name: str) -> float:
        """Sum of a counter's ``_total`` samples over its labels on vLLM's ``/metrics``
        (``name`` with or without ``_total``); 0 when vLLM does not export it yet."""
        from dscache_tools.chaos.counters import counter_total

        text = self._httpx.get(f"{self.url}/metrics", timeout=10).text
        return counter_total(text, name.removesuffix("_total")) or 0.0

    def stop(self) -> None:
        """SIGTERM to its process group (vLLM's engine core included), then SIGKILL
        after a minute; idempotent."""
        self.child.stop(grace_s=60.0)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
