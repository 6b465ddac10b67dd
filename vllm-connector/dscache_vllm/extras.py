"""What decides a vLLM request's KV besides its tokens: LoRA adapters and multimodal items.

Two requests with the same token ids can hold different KV: a LoRA adapter changes
every layer's K and V, and the tokens behind an image's placeholder are the same
for every image. vLLM keys its own prefix cache apart with per-block *extra keys*;
dscache does the same through the key contract's block extras
(:func:`dscache.keys.block_extra`):

* ``["lora", name, digest]`` on every block of a request with an adapter, where
  ``digest`` is the SHA-256 of the adapter's files (:func:`adapter_digest`), so a
  name re-pointed at other weights never reuses KV;
* ``["mm", identifier, offset]`` on every block that a multimodal item's
  placeholder tokens overlap: vLLM's hash of the item (its content and processor
  options) and where the placeholder starts relative to the block. Blocks after
  the item chain from its block's key, so they differ too; blocks before it do not
  depend on it and are shared.

Inputs the connector cannot key are not cached at all (:attr:`RequestInputs.uncacheable`
names why): prompt embeddings instead of token ids, an item vLLM did not hash, an
adapter whose files cannot be read, and any kind of extra key this module does not
know (a newer vLLM's new input kind is refused, never ignored).

Contract: pure functions of plain data (no vLLM import); :func:`adapter_digest` is
the only one that reads files, and caches its answer per path until a file in the
adapter changes (size, mtime or inode).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dscache.keys import block_extra

#: vLLM's kinds of block extra keys that this connector keys (``cache_salt`` is the
#: tenant, handled by the chain's root) or refuses knowingly.
KNOWN_KINDS = frozenset({"lora", "mm", "cache_salt", "prompt_embeds"})

#: Reasons a request is not cached (the ``reason`` label of ``uncached_requests``).
PROMPT_EMBEDS = "prompt_embeds"
MM_UNHASHED = "mm_unhashed"
LORA_UNREADABLE = "lora_unreadable"
UNKNOWN_INPUT = "unknown_input"
REASONS = (PROMPT_EMBEDS, MM_UNHASHED, LORA_UNREADABLE, UNKNOWN_INPUT)


@dataclass(frozen=True)
class MMItem:
    """One multimodal item: vLLM's identifier and its placeholder's token range."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class RequestInputs:
    """What besides the tokens decides a request's KV.

    Attributes:
        lora: the adapter's ``(name, digest)``, or None.
        mm: the multimodal items, by placeholder offset.
        uncacheable: why this request must not be cached (None: it may be).
    """

    lora: tuple[str, str] | None = None
    mm: tuple[MMItem, ...] = ()
    uncacheable: str | None = None

    @property
    def plain(self) -> bool:
        """Token ids alone decide the KV (no extras at all)."""
        return self.lora is None and not self.mm

    def extras(self, first: int, end: int, block_tokens: int) -> list[bytes]:
        """The ``block_extra`` of blocks ``first .. end - 1`` (``b""`` for plain ones)."""
        if self.plain:
            return [b""] * (end - first)
        out: list[bytes] = []
        for b in range(first, end):
            start, stop = b * block_tokens, (b + 1) * block_tokens
            items: list[list[str | int]] = []
            if self.lora is not None:
                items.append(["lora", *self.lora])
            for m in self.mm:
                if m.offset < stop and m.offset + m.length > start:
                    items.append(["mm", m.identifier, m.offset - start])
            out.append(block_extra(items))
        return out


PLAIN = RequestInputs()


def request_inputs(
    *,
    lora: tuple[str, str] | None,
    mm: Sequence[tuple[str | None, int, int]],
    extra_kinds: Sequence[str] = (),
    prompt_embeds: bool = False,
) -> RequestInputs:
    """A request's inputs from the facts vLLM holds.

    Args:
        lora: the adapter's ``(name, path)``, or None.
        mm: each multimodal item's ``(identifier, offset, length)``.
        extra_kinds: the kinds of vLLM's own block extra keys for the request.
        prompt_embeds: the request came as embeddings, not token ids.
    """
    if prompt_embeds:
        return RequestInputs(uncacheable=PROMPT_EMBEDS)
    if any(kind not in KNOWN_KINDS for kind in extra_kinds):
        return RequestInputs(uncacheable=UNKNOWN_INPUT)
    items: list[MMItem] = []
    for identifier, offset, length in mm:
        if not identifier:
            return RequestInputs(uncacheable=MM_UNHASHED)
        items.append(MMItem(identifier, int(offset), int(length)))
    items.sort(key=lambda m: (m.offset, m.identifier))
    keyed: tuple[str, str] | None = None
    if lora is not None:
        name, path = lora
        digest = adapter_digest(path)
        if digest is None:
            return RequestInputs(uncacheable=LORA_UNREADABLE)
        keyed = (name, digest)
    return RequestInputs(lora=keyed, mm=tuple(items))


@dataclass
class _Digests:
    lock: threading.Lock = field(default_factory=threading.Lock)
    cache: dict[str, tuple[tuple[tuple[str, int, int, int], ...], str]] = field(
        default_factory=dict
    )


_DIGESTS = _Digests()


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file())


def adapter_digest(path: str) -> str | None:
    """``sha256:<hex>`` of a LoRA adapter's files (names, sizes, bytes), or None when
    ``path`` is not a readable local file or directory.

    Computed once per path and kept while no file in it changes (name, size, mtime,
    inode): a re-pointed or rewritten adapter gets a new digest, a request for an
    unchanged one costs a few ``stat`` calls.
    """
    root = Path(path)
    try:
        files = _files(root)
        stamp = tuple(
            (
                str(f.relative_to(root)) if f != root else f.name,
                st.st_size,
                st.st_mtime_ns,
                st.st_ino,
            )
            for f in files
            for st in (f.stat(),)
        )
    except OSError:
        return None
    if not files:
        return None
    with _DIGESTS.lock:
        cached = _DIGESTS.cache.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    h = hashlib.sha256(b"dscache/lora/v1\x00")
    try:
        for f, (name, size, _mtime, _ino) in zip(files, stamp, strict=True):
            h.update(f"{name}\x00{size}\x00".encode())
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
    except OSError:
        return None
    digest = "sha256:" + h.hexdigest()
    with _DIGESTS.lock:
        _DIGESTS.cache[path] = (stamp, digest)
    return digest


def clear_digests() -> None:
    """Forgets every cached adapter digest (tests)."""
    with _DIGESTS.lock:
        _DIGESTS.cache.clear()
