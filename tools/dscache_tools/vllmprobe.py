"""A vLLM engine in a child process (``python -m dscache_vllm.probe``), from tests and benches.

vLLM pins its own torch and transformers, so it lives in an environment of its
own: :func:`vllm_python` finds that interpreter (``DSCACHE_VLLM_PYTHON``, else the
repository's ``.venv-vllm``, which ``scripts/setup-vllm.sh`` creates).

Contract: :class:`VllmProbe` starts the engine and waits for its ready line; each
call sends one command and returns its answer (raising ``RuntimeError`` on an
``error`` answer or when the child exits); :meth:`close` never leaves a child
behind. The child's whole output goes to ``log``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
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
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
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

    def __enter__(self) -> VllmProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
