"""What vLLM pods hold in their GPU prefix cache, from vLLM's own KV events.

A vLLM pod started with ``--kv-events-config`` publishes ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` for its GPU prefix cache (medium ``GPU``).
Those blocks are named by vLLM's own block hashes, which nothing outside the
engine can compute (their root is seeded per process), but every ``BlockStored``
carries its blocks' tokens and its parent's hash. So the picker keys them by
content: a chain over tokens, which it computes for a request's tokens too. A hit
there is cheaper than one in the pod's store (no load at all), and it is the part
of a pod's cache its sidecar does not see.

Contract:
    * A block's content key chains over its tokens: ``xxh3_128(parent key +
      token ids as int32 little-endian)``, where a first block's parent key is
      :func:`root` of its LoRA adapter name (``b""`` for the base model) and every
      other block's is its parent block's content key. :func:`token_chain` is the
      same chain over a request's tokens, one key per whole block.
    * A ``BlockStored`` block whose parent the index does not know (its store event
      was lost, or it came before the picker subscribed) or that has multimodal or
      prompt-embedding extra keys (its tokens do not say what it holds) is not
      indexed, and neither is any block after it in that event. Strings among the
      extra keys (the LoRA name, a cache salt) are ignored: the index advises a
      route, it never hands out KV.
    * ``BlockRemoved`` forgets vLLM hashes; a content key is held while any of the
      pod's hashes with that content is. ``AllBlocksCleared`` forgets everything,
      and so does :meth:`GpuTier.events_lost` (the pod's feed reconnected: the
      engine may be a new process).
    * Bounded: at most ``max_blocks`` hashes per pod, the oldest dropped first
      (vLLM's GPU cache holds far fewer blocks; only missed removals grow it).
    * There is no baseline: vLLM publishes none and replays a bounded buffer, so the
      index holds what was heard since the feed connected (and what the replay
      brought). A block it missed is never claimed; a removal it missed leaves a
      claim until the hash is removed, the pod's feed reconnects or the bound drops
      it. A wrong claim costs a worse choice, never a wrong answer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

#: Hashes kept per pod (vLLM's GPU cache is usually tens of thousands of blocks).
MAX_BLOCKS = 500_000


def root(lora_name: str | None) -> bytes:
    """The parent key of a first block: the base model's (``b""``) or an adapter's."""
    if not lora_name:
        return b""
    return xxhash.xxh3_128_digest(b"lora\0" + lora_name.encode())


def _key(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    return xxhash.xxh3_128_digest(parent + np.asarray(tokens, dtype="<i4").tobytes())


def token_chain(parent: bytes, ids: Sequence[int], block_size: int) -> list[bytes]:
    """The content keys of ``ids``' whole blocks of ``block_size`` tokens, from ``parent``."""
    if block_size <= 0:
        return []
    arr = np.asarray(ids, dtype="<i4")
    keys: list[bytes] = []
    for start in range(0, len(arr) - block_size + 1, block_size):
        parent = _key(parent, arr[start : start + block_size])  # the events' key, exactly
        keys.append(parent)
    return keys


def _opaque(extra: Any) -> bool:
    """Extra keys that the tokens do not stand for: an image's (list: identifier and
    offset) or prompt embeddings' (bytes). Strings (LoRA name, cache salt) are not."""
    if not extra:
        return False
    return any(isinstance(e, (list, tuple, bytes)) for e in extra)


@dataclass
class _Pod:
    block_size: int = 0
    #: vLLM's block hash -> content key, oldest first.
    hashes: OrderedDict[Hashable, bytes] = field(default_factory=OrderedDict)
    #: content key -> how many of the pod's hashes have it.
    held: dict[bytes, int] = field(default_factory=dict)

    def forget(self, block_hash: Hashable) -> None:
        content = self.hashes.pop(block_hash, None)
        if content is None:
            return
        n = self.held.get(content, 0) - 1
        if n > 0:
            self.held[content] = n
        else:
            self.held.pop(content, None)

    def stored(self, event: dict[str, Any], max_blocks: int) -> int:
        """Indexes a ``BlockStored`` event; returns the blocks indexed."""
        hashes = event.get("block_hashes") or []
        tokens = event.get("token_ids") or []
        size = event.get("block_size")
        if not isinstance(size, int) or size <= 0 or not isinstance(tokens, list):
            return 0
        extras = event.get("extra_keys") or []
        parent_hash = event.get("parent_block_hash")
        if parent_hash is None:
            parent: bytes | None = root(event.get("lora_name") or None)
        else:
            parent = self.hashes.get(parent_hash) if isinstance(parent_hash, Hashable) else None
        self.block_size = size
        n = 0
        for i, block_hash in enumerate(hashes):
            chunk = tokens[i * size : (i + 1) * size]
            extra = extras[i] if i < len(extras) else None
            if parent is None or len(chunk) < size or _opaque(extra):
                break
            if not isinstance(block_hash, Hashable):
                break
            parent = _key(parent, chunk)
            self.forget(block_hash)  # a hash stored again: counted once
            self.hashes[block_hash] = parent
            self.held[parent] = self.held.get(parent, 0) + 1
            n += 1
        while len(self.hashes) > max_blocks:
            self.forget(next(iter(self.hashes)))
        return n


class GpuTier:
    """Every vLLM pod's GPU-cached blocks by content (the module contract); the
    target of an :class:`~dscache_router.eventfeed.EventFeed` without baselines."""

    def __init__(
        self,
        pods: Callable[[], list[str]],
        max_blocks: int = MAX_BLOCKS,
        following: Callable[[int], None] | None = None,
    ) -> None:
        """``pods`` lists the pods to follow (the picker's ``pods``); ``following`` is
        told how many pods have blocks indexed whenever that may have changed."""
        self._list_pods = pods
        self._max_blocks = max_blocks
        self._following = following
        self._lock = threading.Lock()
        self._pods: dict[str, _Pod] = {}

    # -- the feed's target ---------------------------------------------------------

    def pods(self) -> list[str]:
        return self._list_pods()

    def events_applied(self, address: str, events: list[dict[str, Any]], baseline: bool) -> bool:
        with self._lock:
            pod = self._pods.setdefault(address, _Pod())
            for event in events:
                kind = event.get("type")
                if kind == "BlockStored":
                    pod.stored(event, self._max_blocks)
                elif kind == "BlockRemoved":
                    for block_hash in event.get("block_hashes") or ():
                        if isinstance(block_hash, Hashable):
                            pod.forget(block_hash)
                elif kind == "AllBlocksCleared":
                    pod.hashes.clear()
                    pod.held.clear()
            self._count()
        return True

    def events_lost(self, address: str) -> None:
        with self._lock:
            self._pods.pop(address, None)
            self._count()

    def _count(self) -> None:
        if self._following is not None:
            self._following(sum(bool(p.held) for p in self._pods.values()))

    # -- what the picker asks --------------------------------------------------------

    def block_size(self, address: str) -> int:
        """The pod's vLLM block size (0: no event from it yet)."""
        with self._lock:
            pod = self._pods.get(address)
            return pod.block_size if pod else 0

    def blocks(self, address: str) -> int:
        with self._lock:
            pod = self._pods.get(address)
            return len(pod.hashes) if pod else 0

    def held_tokens(
        self, ids: Sequence[int], roots: Iterable[bytes], pods: Iterable[str]
    ) -> dict[str, int]:
        """For each of ``pods`` whose GPU holds a block of ``ids``: the tokens of the
        longest prefix it holds, under any of ``roots`` (the base model's, an adapter's)."""
        out: dict[str, int] = {}
        chains: dict[tuple[bytes, int], list[bytes]] = {}
        roots = list(roots)
        with self._lock:
            for address in pods:
                pod = self._pods.get(address)
                if pod is None or not pod.held or pod.block_size <= 0:
                    continue
                best = 0
                for parent in roots:
                    chain = chains.get((parent, pod.block_size))
                    if chain is None:
                        chain = chains[(parent, pod.block_size)] = token_chain(
                            parent, ids, pod.block_size
                        )
                    n = 0
                    for key in chain:
                        if key not in pod.held:
                            break
                        n += 1
                    best = max(best, n * pod.block_size)
                if best:
                    out[address] = best
        return out
