"""The picker learns vLLM pods' GPU prefix caches from vLLM's own KV events.

vLLM names its blocks by hashes nobody else can compute, but each ``BlockStored``
carries its tokens and its parent: the picker keys them by content
(:mod:`dscache_router.gputier`) and matches a request's tokens against them. The
events here have vLLM's shape (a ``type`` tag, ``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_name``,
``extra_keys``); ``tests/vllm/test_serve.py`` checks them against a real vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import pytest
import zmq
from dscache_router.eventfeed import EventFeed
from dscache_router.gputier import GpuTier, root, token_chain
from dscache_router.picker import Picker, PickerSettings
from dscache_server.tokenizer import ChatMessage, DeepSeekTokenizer
from dscache_sidecar.holdings import HoldingsFilter
from dscache_tools.net import free_port
from dscache_tools.polling import wait_until
from test_picker import BT, DOC, ROOT, A, B, C, chat, keys_of, query

VBS = 16  # vLLM's block size here


def stored(
    hashes: Sequence[int],
    tokens: Sequence[int],
    parent: int | None = None,
    *,
    lora: str | None = None,
    extra: list[Any] | None = None,
) -> dict[str, Any]:
    """A ``BlockStored`` as vLLM's decoder hands it over (a msgspec tagged struct)."""
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": VBS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": lora,
        **({"extra_keys": extra} if extra is not None else {}),
    }


def removed(hashes: Sequence[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


IDS = list(range(1000, 1000 + 6 * VBS))  # six whole blocks
BASE = [root(None)]


def tier_with(*events: dict[str, Any], pod: str = A) -> GpuTier:
    tier = GpuTier(lambda: [pod])
    tier.events_applied(pod, list(events), baseline=False)
    return tier


def test_a_stored_chain_is_matched_by_content_as_far_as_the_tokens_agree() -> None:
    tier = tier_with(stored([11, 12, 13], IDS[: 3 * VBS]))
    assert tier.held_tokens(IDS, BASE, [A]) == {A: 3 * VBS}
    # The chain goes on in a later event, from its parent's hash.
    tier.events_applied(A, [stored([14], IDS[3 * VBS : 4 * VBS], parent=13)], baseline=False)
    assert tier.held_tokens(IDS, BASE, [A]) == {A: 4 * VBS}
    # A request that differs in its second block holds only the first.
    other = IDS[:VBS] + [7] * (3 * VBS)
    assert tier.held_tokens(other, BASE, [A]) == {A: VBS}
    # A pod that announced nothing is not in the answer.
    assert tier.held_tokens(IDS, BASE, [A, B]) == {A: 4 * VBS}


def test_removals_cut_the_chain_and_shared_content_stays_while_one_hash_holds_it() -> None:
    tier = tier_with(stored([11, 12, 13], IDS[: 3 * VBS]))
    tier.events_applied(A, [removed([12])], baseline=False)
    assert tier.held_tokens(IDS, BASE, [A]) == {A: VBS}
    # The same tokens under another hash (another cache salt): held while either is.
    tier = tier_with(stored([11, 12], IDS[: 2 * VBS]), stored([21, 22], IDS[: 2 * VBS]))
    tier.events_applied(A, [removed([12])], baseline=False)
    assert tier.held_tokens(IDS, BASE, [A]) == {A: 2 * VBS}
    tier.events_applied(A, [removed([22])], baseline=False)
    assert tier.held_tokens(IDS, BASE, [A]) == {A: VBS}
    tier.events_applied(A, [{"type": "AllBlocksCleared"}], baseline=False)
    assert tier.held_tokens(IDS, BASE, [A]) == {}


def test_blocks_the_tokens_do_not_describe_are_not_claimed() -> None:
    # A parent the picker never heard of (its event was lost): nothing to chain from.
    assert (
        tier_with(stored([31, 32], IDS[VBS : 3 * VBS], parent=99)).held_tokens(IDS, BASE, [A]) == {}
    )
    # An image's placeholder tokens in the second block: the chain stops before it.
    image = [None, [["img-sha", 0]], None]
    assert tier_with(stored([11, 12, 13], IDS[: 3 * VBS], extra=image)).held_tokens(
        IDS, BASE, [A]
    ) == {A: VBS}
    # A cache salt (a string) changes vLLM's hash, not what the tokens are.
    salted = [["tenant-a"], ["tenant-a"]]
    assert tier_with(stored([11, 12], IDS[: 2 * VBS], extra=salted)).held_tokens(
        IDS, BASE, [A]
    ) == {A: 2 * VBS}


def test_an_adapters_blocks_match_only_requests_for_that_adapter() -> None:
    tier = tier_with(stored([11, 12], IDS[: 2 * VBS], lora="finance-lora"))
    assert tier.held_tokens(IDS, BASE, [A]) == {}
    assert tier.held_tokens(IDS, [*BASE, root("finance-lora")], [A]) == {A: 2 * VBS}
    assert tier.held_tokens(IDS, [*BASE, root("other")], [A]) == {}


def test_the_index_is_bounded_oldest_first_and_a_lost_feed_forgets_the_pod() -> None:
    tier = GpuTier(lambda: [A], max_blocks=4)
    tier.events_applied(A, [stored([1, 2, 3], IDS[: 3 * VBS])], baseline=False)
    other = [5] * (3 * VBS)
    tier.events_applied(A, [stored([4, 5, 6], other)], baseline=False)
    assert tier.blocks(A) == 4
    assert tier.held_tokens(IDS, BASE, [A]) == {}  # its first block was the oldest
    assert tier.held_tokens(other, BASE, [A]) == {A: 3 * VBS}
    tier.events_lost(A)
    assert tier.blocks(A) == 0 and tier.held_tokens(other, BASE, [A]) == {}


def test_token_chain_keys_whole_blocks_only() -> None:
    assert len(token_chain(b"", IDS[: 2 * VBS + 5], VBS)) == 2
    assert token_chain(b"", IDS, VBS)[:2] == token_chain(b"", IDS[: 2 * VBS], VBS)
    assert token_chain(root("x"), IDS, VBS)[0] != token_chain(b"", IDS, VBS)[0]


# -- the picker ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> DeepSeekTokenizer:
    return DeepSeekTokenizer()


@pytest.fixture
def gpu_picker(tokenizer: DeepSeekTokenizer) -> Iterator[Picker]:
    p = Picker(PickerSettings(memory_s=0.0, gpu_min_tokens=64), tokenizer)
    p.know([A, B, C])
    yield p


def doc_ids(tokenizer: DeepSeekTokenizer) -> list[int]:
    return tokenizer.apply_chat_template([ChatMessage(m["role"], m["content"]) for m in chat(DOC)])


def announce(picker: Picker, pod: str, ids: list[int], blocks: int, first_hash: int = 1) -> None:
    hashes = list(range(first_hash, first_hash + blocks))
    picker.gpu.events_applied(pod, [stored(hashes, ids[: blocks * VBS])], baseline=False)


def test_the_pod_whose_gpu_holds_the_prompt_gets_it(
    gpu_picker: Picker, tokenizer: DeepSeekTokenizer
) -> None:
    ids = doc_ids(tokenizer)
    assert len(ids) >= 10 * VBS
    announce(gpu_picker, B, ids, 8)
    choice = gpu_picker.pick(query(chat(DOC)))
    assert (choice.pod, choice.reason, choice.tier, choice.blocks) == (B, "prefix", "gpu", 8)
    assert (
        gpu_picker.metrics.registry.get_sample_value(
            "dscache_picker_prefix_tier_total", {"tier": "gpu"}
        )
        == 1
    )
    # Under the minimum (a chat template's opening is shared by everyone): the hash.
    gpu_picker.gpu.events_lost(B)
    announce(gpu_picker, B, ids, 3)
    assert gpu_picker.pick(query(chat(DOC))).reason != "prefix"


def test_the_longest_prefix_wins_across_tiers_and_a_tie_goes_to_the_gpu(
    gpu_picker: Picker, tokenizer: DeepSeekTokenizer
) -> None:
    ids = doc_ids(tokenizer)
    keys = keys_of(tokenizer, chat(DOC))  # the store's blocks: 16 tokens here too
    assert BT == VBS
    for pod in (A, B, C):
        gpu_picker.set_keyinfo(pod, ROOT, BT)
    gpu_picker.set_holdings(A, HoldingsFilter.of(keys[:9], capacity=1024))
    announce(gpu_picker, B, ids, 6)
    choice = gpu_picker.pick(query(chat(DOC)))
    assert (choice.pod, choice.tier, choice.blocks) == (A, "store", 9)
    gpu_picker.gpu.events_lost(B)
    announce(gpu_picker, B, ids, 9)
    choice = gpu_picker.pick(query(chat(DOC)))
    assert (choice.pod, choice.tier, choice.blocks) == (B, "gpu", 9)


def test_no_gpu_match_for_credentials_pins_or_pods_over_the_bound(
    gpu_picker: Picker, tokenizer: DeepSeekTokenizer
) -> None:
    announce(gpu_picker, B, doc_ids(tokenizer), 8)
    assert gpu_picker.pick(query(chat(DOC), credentials=True)).reason != "prefix"
    assert gpu_picker.pick(query(chat(DOC), pinned=C)).pod == C
    # A pin to a pod no longer among the candidates is no pin: the GPU still counts.
    gone = gpu_picker.pick(query(chat(DOC), pods=f"{A}/0,{B}/0", pinned=C))
    assert (gone.pod, gone.tier) == (B, "gpu")
    over = gpu_picker.pick(query(chat(DOC), pods=f"{A}/0,{B}/5,{C}/0", cap=2))
    assert over.pod != B


# -- the feed without baselines, over ZeroMQ ------------------------------------------


class VllmStylePublisher:
    """A stand-in for vLLM's ``ZmqEventPublisher`` (typed, small, named as such): a PUB
    sending ``(topic, seq, msgpack KVEventBatch)`` and a ROUTER replaying its buffer
    from a requested number, ended by ``END_SEQ``. No baseline, no login, as vLLM.
    The real one runs in ``tests/vllm/test_serve.py``."""

    END = (-1).to_bytes(8, "big", signed=True)

    def __init__(self) -> None:
        self.port, self.replay_port = free_port(), free_port()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(f"tcp://127.0.0.1:{self.port}")
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self._buffer: list[tuple[int, bytes]] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def publish(self, events: list[dict[str, Any]], *, skip_live: bool = False) -> None:
        """One batch; ``skip_live``: buffered for replay but not sent (a lost batch)."""
        payload = msgspec.msgpack.encode([1.0 + self._seq, events, None])
        with self._lock:
            seq, self._seq = self._seq, self._seq + 1
            self._buffer.append((seq, payload))
            if not skip_live:
                self._pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            client, _, start = self._router.recv_multipart()
            with self._lock:
                for seq, payload in self._buffer:
                    if seq >= int.from_bytes(start, "big"):
                        frames = [client, b"", b"", seq.to_bytes(8, "big"), payload]
                        self._router.send_multipart(frames)
                self._router.send_multipart([client, b"", b"", self.END, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()


@pytest.mark.slow  # sockets and a thread, waits on delivery
def test_the_feed_starts_from_the_replay_and_repairs_a_lost_batch(
    tokenizer: DeepSeekTokenizer,
) -> None:
    pod = "127.0.0.1:8000"
    picker = Picker(PickerSettings(memory_s=0.0, gpu_min_tokens=64), tokenizer)
    picker.know([pod])
    ids = doc_ids(tokenizer)
    publisher = VllmStylePublisher()
    # Published before the picker subscribed: only the replay brings it.
    publisher.publish([stored([1, 2, 3, 4], ids[: 4 * VBS])])
    feed = EventFeed(
        picker.gpu, publisher.port, publisher.replay_port, check_s=0.1, baselines=False
    )
    feed.start()
    try:

        def held() -> int:
            return picker.gpu.held_tokens(ids, BASE, [pod]).get(pod, 0)

        wait_until("the replayed blocks", lambda: held() == 4 * VBS, timeout=20)
        assert picker.metrics.registry.get_sample_value("dscache_picker_gpu_pods") == 1
        # Live from here; a batch lost on the way (5) is asked for again when the
        # next one (6) shows the gap.
        publisher.publish([stored([5], ids[4 * VBS : 5 * VBS], parent=4)], skip_live=True)
        publisher.publish([stored([6], ids[5 * VBS : 6 * VBS], parent=5)])
        wait_until("the lost batch replayed", lambda: held() == 6 * VBS, timeout=20)
        publisher.publish([removed([2])])
        wait_until("the removal", lambda: held() == VBS, timeout=20)
    finally:
        feed.stop()
        publisher.close()
    # A stopped feed closes its sockets and forgets what it heard.
    assert held() == 0
    assert picker.metrics.registry.get_sample_value("dscache_picker_gpu_pods") == 0
