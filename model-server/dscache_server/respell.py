"""Following the tokenization a conversation's KV was stored with.

A prompt that arrives as text (a chat, a text completion) is encoded by the
template. The KV stored for the same text may come from other ids: the ids a model
generated (a server remembers them per process, ``PieceCache.remember_answer`` and
``Continuations``), so after a restart, or on another pod that shares the node's
store, encoding the text again splits an earlier answer differently and every block
from there on misses. The sidecar keeps each block's token ids (``Descendants``);
this module follows them.

Contract:
    * ``Spelling.follow`` takes a prompt's ids, the number of its leading tokens
      whose blocks are stored, and the stored blocks under the last of them, and
      follows the blocks whose tokens spell exactly the prompt's next bytes. The
      result is the prompt's leading ids, the followed blocks' ids, a short
      "bridge" encoded anew where the two tokenizations' boundaries do not meet,
      and then the prompt's own ids: an answer's remembered ids and every piece
      after the followed blocks are kept as the template made them.
    * An added token (a turn marker, a special token) only ever matches itself,
      never text that spells the same characters: the structure of a
      conversation is not changed.
    * The result spells the same bytes as the prompt (checked, else the prompt is
      returned unchanged); any doubt returns the prompt unchanged.
    * The ids are only a choice of tokenization: the caller's cache computes every
      key again from the ids the model is fed, so tokens a store reports wrongly
      cost a miss, never a wrong KV.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
from tokenizers import Tokenizer

from dscache_server.kvstore import StoredBlock

#: How an added token (a turn marker, a special token) is spelled: 0xFF never
#: occurs in UTF-8 text, so no text spells one (its id follows, four bytes). Text
#: that reads like a marker is encoded as the marker by the template, while a
#: model may have generated it as plain tokens: those must not pass for each other.
_MARKER = b"\xff\xfe"


def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet: the character that stands for each byte (printable
    bytes for themselves, the rest shifted past U+0100), inverted."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    shifted = 0x100
    for b in range(256):
        if b not in chars:
            chars[b] = shifted
            shifted += 1
    return {chr(c): b for b, c in chars.items()}


#: Asks the store for the blocks under a key, those directly under it only when
#: they start with one of the given tokens: (blocks, whether the answer was cut).
Below = Callable[[bytes, Sequence[int]], tuple[list[StoredBlock], bool]]
#: The longest token spelling looked for when naming a block's possible first
#: tokens (DeepSeek's longest plain token is shorter).
_LONGEST_TOKEN = 128


class Spelling:
    """The bytes each token id spells, and the walk over stored blocks.

    Built lazily (0.2 s for DeepSeek's 129k ids): a server that never needs it
    never pays. Thread safe.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._table: list[bytes] | None = None
        self._ids: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def _bytes(self) -> list[bytes]:
        with self._lock:
            if self._table is None:
                added = self._tok.get_added_tokens_decoder()
                byte_of = _byte_of_char()
                table: list[bytes] = []
                for i in range(self._tok.get_vocab_size(with_added_tokens=True)):
                    if i in added:
                        table.append(_MARKER + i.to_bytes(4, "little"))
                    else:
                        piece = self._tok.id_to_token(i) or ""
                        table.append(bytes(byte_of[c] for c in piece if c in byte_of))
                self._table = table
                self._ids = {b: i for i, b in enumerate(table) if b}
            return self._table

    def starts(self, text: bytes, pos: int) -> list[int]:
        """The tokens whose spelling ``text`` continues with at ``pos``: whatever
        tokenized it, a block that starts there starts with one of them."""
        self._bytes()
        ids = self._ids
        end = min(len(text), pos + _LONGEST_TOKEN)
        return [i for n in range(pos + 1, end + 1) if (i := ids.get(text[pos:n])) is not None]

    def spell(self, ids: Sequence[int]) -> bytes:
        """The bytes ``ids`` spell (added tokens as markers no text can spell)."""
        table = self._bytes()
        return b"".join(table[i] for i in ids)

    def follow(
        self,
        ids: Sequence[int],
        start: int,
        parent: bytes,
        below: Below,
        encode: Callable[[str], list[int]],
    ) -> tuple[list[int], int]:
        """``ids`` with the stored blocks under ``parent`` (the block that ends at
        token ``start``) followed as far as they spell the prompt; and how many
        tokens were followed (0: ``ids`` unchanged)."""
        tail = ids[start:]
        # The first tokens are enough to name what a block there can start with
        # (each spells a byte at least): spell the whole tail only if one exists.
        head = self.spell(tail[:_LONGEST_TOKEN])
        blocks, cut = below(parent, self.starts(head, 0))
        if not blocks:
            return list(ids), 0
        text = self.spell(tail)
        followed, pos = self._walk(text, parent, below, (blocks, cut))
        if not followed:
            return list(ids), 0
        spliced = self._splice(tail, text, pos, encode)
        if spliced is None:
            return list(ids), 0
        out = [*ids[:start], *followed, *spliced]
        if self.spell(out[start:]) != text:
            return list(ids), 0
        return out, len(followed)

    def _walk(
        self, text: bytes, parent: bytes, below: Below, first: tuple[list[StoredBlock], bool]
    ) -> tuple[list[int], int]:
        """The stored blocks from ``parent`` down (``first``: the store's answer for
        ``parent``) that spell ``text``'s start: their ids, and the bytes they spell
        (ending on a character boundary)."""
        table = self._bytes()
        children: dict[bytes, list[StoredBlock]] = {}

        def take(answer: tuple[list[StoredBlock], bool]) -> bool:
            for b in answer[0]:
                children.setdefault(b.parent, []).append(b)
            return answer[1]

        cut = take(first)
        steps: list[tuple[Sequence[int], int]] = []  # (ids, bytes) per block
        pos = 0
        while True:
            if parent not in children and cut:
                cut = take(below(parent, self.starts(text, pos)))
            for child in children.get(parent, ()):
                if any(i >= len(table) for i in child.token_ids):
                    continue  # not this tokenizer's ids: never a match
                spelled = b"".join(table[i] for i in child.token_ids)
                if spelled and text.startswith(spelled, pos):
                    steps.append((child.token_ids, len(spelled)))
                    pos += len(spelled)
                    parent = child.key
                    break
            else:
                break
        # End on a character boundary: what follows must be text again.
        while steps and pos < len(text) and text[pos] & 0xC0 == 0x80:
            pos -= steps.pop()[1]
        return [i for block, _ in steps for i in block], pos

    def _splice(
        self, tail: Sequence[int], text: bytes, pos: int, encode: Callable[[str], list[int]]
    ) -> list[int] | None:
        """What follows byte ``pos`` of ``text`` (which ``tail`` spells): a bridge
        encoded anew up to the first boundary of ``tail``'s tokens on a character,
        then ``tail``'s own ids. None when the bridge is not text."""
        if pos == len(text):
            return []
        table = self._bytes()
        ends = np.cumsum(np.fromiter((len(table[i]) for i in tail), np.int64, len(tail)))
        k = int(np.searchsorted(ends, pos))  # the first token that reaches pos
        if ends[k] == pos:
            return list(tail[k + 1 :])
        while ends[k] < len(text) and text[ends[k]] & 0xC0 == 0x80:
            k += 1
        try:
            bridge = encode(text[pos : ends[k]].decode("utf-8"))
        except UnicodeDecodeError:
            return None
        return [*bridge, *tail[k + 1 :]]
