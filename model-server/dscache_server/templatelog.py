"""Live template mining: the prompt prefixes many requests share, counted as they are served.

The offline miner (``dscache templates mine``) needs captured prompts; this one
counts, per tenant, the block-aligned prefixes of the requests the server sees,
and lists the ones worth prewarming by the same rules
(:mod:`dscache_server.templaterank`).

Contract:
    * :meth:`TemplateLog.record` takes one request: its tenant id, conversation
      (session id, or None), prompt token ids and chained block keys
      (:meth:`dscache.keys.KeyChain.keys`, the keys the cache uses). Its prefixes of
      1 to ``max_blocks`` full blocks are counted, each named by its last block's
      key (a SHA-256 chain: the key reveals no text).
    * Kept per (tenant, key): a request count, the distinct conversations among
      them (keyed 64-bit hashes with a per-process random key, at most
      :data:`CONVERSATION_CAP`; a request without one is its own), and the
      prefix's token ids. Token ids are the only prompt content kept, and only
      :meth:`TemplateLog.top` hands them out (the server shows them to the gateway
      only).
    * Bounded: at most ``capacity`` entries (Space-Saving): a new prefix in a full
      log replaces one of the smallest count ``m`` and starts at ``m + 1`` with
      error ``m``. A count overestimates by at most its error, itself at most
      ``N / capacity`` for ``N`` recorded prefixes; a prefix seen more than
      ``N / capacity`` times is always held. A replaced entry's conversations are
      not carried over, so conversations are a lower bound: one-off prompts never
      pass for templates on an inherited count.
    * Memory: the token ids of one request are one ``array('I')`` its entries
      share, so ids take at most ``capacity x max_blocks x block_tokens x 4``
      bytes (8 MiB at the defaults: 1024 x 8 x 256 x 4), plus per entry
      ``CONVERSATION_CAP x 8`` bytes of hashes and ``max_blocks x 32`` of keys.
    * Thread-safe: one lock; ranking runs on a snapshot, outside it.
    * Only tenants a gateway can name are recorded (:func:`replayable`): the
      anonymous ``default`` and ``tenant:<name>``. A hashed API key's tenant could be
      prewarmed only with that key, which no operator holds.
    * :func:`fetch_templates` merges several servers' lists by (tenant, key) and
      ranks the merged counts again: a server that fails or answers malformed JSON
      is logged and skipped. A template a server did not list (not in its top, or
      covered by a longer one there) adds nothing to the merged count, so merged
      counts are lower bounds; merged conversations are sums (an upper bound when
      one conversation reached two servers).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import secrets
import threading
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from dscache.keys import KEY_BYTES
from dscache_server.auth import DEFAULT_TENANT, GATEWAY_TOKEN_HEADER, TENANT_NAME
from dscache_server.templaterank import Counted, Ranked, select

log = logging.getLogger(__name__)

#: Distinct conversations counted per entry; more count as this many.
CONVERSATION_CAP = 64
#: Where the server lists its templates (``routes``), and their filter.
TEMPLATES_PATH = "/dscache/templates"
FILTER_PATH = "/dscache/templates/filter"
#: Most templates one listing may ask for.
MAX_TOP = 1000
#: The prefix of a tenant id a gateway (or the API-key file) names.
NAMED_TENANT = "tenant:"
_MAX_TOKEN_ID = 2**32 - 1


def replayable(tenant: str) -> bool:
    """Whether a gateway can send requests as ``tenant`` (a tenant id of ``auth``)."""
    if tenant == DEFAULT_TENANT:
        return True
    return (
        tenant.startswith(NAMED_TENANT)
        and TENANT_NAME.match(tenant[len(NAMED_TENANT) :]) is not None
    )


@dataclass(frozen=True)
class MinedTemplate:
    """One template worth prewarming.

    Attributes:
        tenant: the tenant id: ``default`` (requests without credentials) or
            ``tenant:<name>``.
        key: its chained block key under the tenant's chain, hex.
        tokens: its token ids, a whole number of blocks.
        prefix_tokens: ``len(tokens)``.
        count: requests that started with it.
        conversations: distinct conversations among them.
        saved_tokens: prefill tokens caching it once saves
            (:mod:`dscache_server.templaterank`).
    """

    tenant: str
    key: str
    tokens: tuple[int, ...]
    prefix_tokens: int
    count: int
    conversations: int
    saved_tokens: int

    @property
    def tenant_header(self) -> str | None:
        """The ``X-Dscache-Tenant`` value that replays it; None: send no tenant header."""
        if self.tenant == DEFAULT_TENANT:
            return None
        return self.tenant[len(NAMED_TENANT) :]

    def to_dict(self) -> dict[str, Any]:
        """Its JSON object, as ``GET /dscache/templates`` lists it."""
        return {
            "tenant": self.tenant,
            "key": self.key,
            "tokens": list(self.tokens),
            "prefix_tokens": self.prefix_tokens,
            "count": self.count,
            "conversations": self.conversations,
            "saved_tokens": self.saved_tokens,
        }

    @classmethod
    def from_dict(cls, data: object) -> MinedTemplate:
        """Parses and checks one listed template.

        Raises:
            ValueError: a field is missing, of the wrong type or out of range.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a template must be a JSON object, got {type(data).__name__}")
        tenant = data.get("tenant")
        if not isinstance(tenant, str) or not replayable(tenant):
            raise ValueError(f"bad tenant {tenant!r}")
        key = data.get("key")
        if not isinstance(key, str) or len(key) != 2 * KEY_BYTES or not _is_hex(key):
            raise ValueError(f"key must be {2 * KEY_BYTES} hex digits")
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ValueError("tokens must be a non-empty list")
        if not all(_is_int(t) and 0 <= t <= _MAX_TOKEN_ID for t in tokens):
            raise ValueError("tokens must be token ids (0 to 2**32 - 1)")
        prefix_tokens, count, conversations, saved_tokens = (
            _count(data, name)
            for name in ("prefix_tokens", "count", "conversations", "saved_tokens")
        )
        if prefix_tokens != len(tokens):
            raise ValueError("prefix_tokens is not the number of tokens")
        if count < 1 or conversations > count:
            raise ValueError("count must be at least 1 and at least conversations")
        return cls(
            tenant, key.lower(), tuple(tokens), prefix_tokens, count, conversations, saved_tokens
        )


def _count(data: Mapping[str, object], name: str) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def _ident(tenant: str, key: bytes) -> bytes:
    """The ranking's name of a (tenant, key): unique even across tenants."""
    return tenant.encode() + b"\0" + key


@dataclass(slots=True, eq=False)
class _Entry:
    """One counted prefix. ``tokens`` is shared by one request's entries: its first
    ``length`` ids are this prefix; the array is never changed once made."""

    tenant: str
    key: bytes
    ancestors: tuple[bytes, ...]  # nearest first
    tokens: array[int]
    length: int
    order: int
    count: int = 0
    error: int = 0
    conversations: array[int] = field(default_factory=lambda: array("Q"))

    def counted(self) -> Counted:
        return Counted(
            key=_ident(self.tenant, self.key),
            ancestors=tuple(_ident(self.tenant, a) for a in self.ancestors),
            tokens=self.length,
            count=self.count,
            conversations=len(self.conversations),
            order=self.order,
            error=self.error,
        )


_Slot = tuple[str, bytes]


class TemplateLog:
    """A bounded, thread-safe count of the block-aligned prefixes requests share."""

    def __init__(self, *, block_tokens: int, capacity: int = 1024, max_blocks: int = 8) -> None:
        if block_tokens < 1 or capacity < 1 or max_blocks < 1:
            raise ValueError("block_tokens, capacity and max_blocks must be at least 1")
        self.block_tokens = block_tokens
        self.capacity = capacity
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._entries: dict[_Slot, _Entry] = {}
        # Space-Saving's stream summary: count -> its entries, oldest first.
        self._buckets: dict[int, dict[_Slot, None]] = {}
        self._min = 0
        self._seen = 0  # entries ever made: their order
        self._requests = 0
        self._anon = itertools.count()  # next() is atomic: no lock needed
        self._hash_key = secrets.token_bytes(16)

    def __len__(self) -> int:
        """Entries held."""
        with self._lock:
            return len(self._entries)

    @property
    def requests(self) -> int:
        """Requests recorded (those with at least one full block)."""
        return self._requests

    def record(
        self, tenant: str, conversation: str | None, ids: Sequence[int], keys: Sequence[bytes]
    ) -> bool:
        """Counts one request's prefixes (see the module contract); False if it has no
        full block. ``keys`` are its chained block keys, at least ``max_blocks`` of them
        when it has that many full blocks."""
        blocks = min(len(keys), len(ids) // self.block_tokens, self.max_blocks)
        if blocks == 0:
            return False
        conv = self._conversation(conversation)
        tokens: array[int] | None = None
        with self._lock:
            self._requests += 1
            for depth in range(1, blocks + 1):
                slot = (tenant, keys[depth - 1])
                entry = self._entries.get(slot)
                if entry is None:
                    if tokens is None:
                        tokens = array("I", ids[: blocks * self.block_tokens])
                    ancestors = tuple(reversed(keys[: depth - 1]))
                    entry = self._insert(slot, ancestors, tokens, depth * self.block_tokens)
                else:
                    self._bump(slot, entry)
                if conv not in entry.conversations and len(entry.conversations) < CONVERSATION_CAP:
                    entry.conversations.append(conv)
        return True

    def top(self, n: int, tenant: str | None = None) -> list[MinedTemplate]:
        """The ``n`` templates worth prewarming most, of one tenant or all, best first."""
        ranked, entries = self._rank(n, tenant)
        return [_template(entries[r.prefix.key], r) for r in ranked]

    def keys(self, n: int) -> list[bytes]:
        """Every block key of the top ``n`` templates (all their prefixes), each once."""
        ranked, entries = self._rank(n, None)
        out: dict[bytes, None] = {}
        for r in ranked:
            e = entries[r.prefix.key]
            out.update(dict.fromkeys(reversed(e.ancestors)))
            out[e.key] = None
        return list(out)

    def _rank(self, n: int, tenant: str | None) -> tuple[list[Ranked], dict[bytes, _Entry]]:
        with self._lock:
            snapshot = [
                (e, e.counted())
                for e in self._entries.values()
                if tenant is None or e.tenant == tenant
            ]
        entries = {c.key: e for e, c in snapshot}
        return select((c for _, c in snapshot), n), entries

    def _conversation(self, conversation: str | None) -> int:
        # A request without a conversation is one of its own: a number of its own
        # (NUL never occurs in a header value, so no session id hashes alike).
        text = conversation.encode() if conversation is not None else b"\0%d" % next(self._anon)
        digest = hashlib.blake2b(text, digest_size=8, key=self._hash_key).digest()
        return int.from_bytes(digest, "little")

    def _insert(
        self, slot: _Slot, ancestors: tuple[bytes, ...], tokens: array[int], length: int
    ) -> _Entry:
        count, error = 1, 0
        if len(self._entries) >= self.capacity:
            smallest = self._min
            victim = next(iter(self._buckets[smallest]))
            self._unfile(victim, smallest)
            del self._entries[victim]
            count, error = smallest + 1, smallest
        self._seen += 1
        entry = _Entry(slot[0], slot[1], ancestors, tokens, length, self._seen, count, error)
        self._entries[slot] = entry
        self._file(slot, count)
        return entry

    def _bump(self, slot: _Slot, entry: _Entry) -> None:
        self._unfile(slot, entry.count)
        entry.count += 1
        self._file(slot, entry.count)

    def _file(self, slot: _Slot, count: int) -> None:
        self._buckets.setdefault(count, {})[slot] = None
        if count < self._min or len(self._entries) == 1:
            self._min = count

    def _unfile(self, slot: _Slot, count: int) -> None:
        bucket = self._buckets[count]
        del bucket[slot]
        if not bucket:
            del self._buckets[count]
            if count == self._min:
                # The entry leaving this bucket is refiled at count + 1 or dropped;
                # either way no entry has fewer than count + 1 now.
                self._min = count + 1


def _template(entry: _Entry, ranked: Ranked) -> MinedTemplate:
    c = ranked.prefix
    return MinedTemplate(
        tenant=entry.tenant,
        key=entry.key.hex(),
        tokens=tuple(entry.tokens[: entry.length]),
        prefix_tokens=entry.length,
        count=c.count,
        conversations=c.conversations,
        saved_tokens=ranked.saved_tokens,
    )


def merge(lists: Iterable[Sequence[MinedTemplate]], top: int) -> list[MinedTemplate]:
    """Several servers' templates as one ranking: same (tenant, key) summed, ranked again."""
    merged: dict[tuple[str, str], MinedTemplate] = {}
    for templates in lists:
        for t in templates:
            had = merged.get((t.tenant, t.key))
            merged[(t.tenant, t.key)] = t if had is None else _plus(had, t)
    counted = _lineage(list(merged.values()))
    by_ident = {c.key: t for c, t in counted}
    ranked = select((c for c, _ in counted), top)
    return [replace(by_ident[r.prefix.key], saved_tokens=r.saved_tokens) for r in ranked]


def _lineage(templates: list[MinedTemplate]) -> list[tuple[Counted, MinedTemplate]]:
    """Each template as a ``Counted`` whose ancestors are the shorter templates of its
    tenant that its tokens start with (keys chain from tokens: same tokens, same key)."""
    by_tokens: dict[tuple[str, tuple[int, ...]], bytes] = {}
    lengths: dict[str, set[int]] = {}
    for t in templates:
        by_tokens[(t.tenant, t.tokens)] = _ident(t.tenant, bytes.fromhex(t.key))
        lengths.setdefault(t.tenant, set()).add(t.prefix_tokens)
    out = []
    for order, t in enumerate(templates):
        shorter = sorted((n for n in lengths[t.tenant] if n < t.prefix_tokens), reverse=True)
        ancestors = tuple(
            a for n in shorter if (a := by_tokens.get((t.tenant, t.tokens[:n]))) is not None
        )
        ident = _ident(t.tenant, bytes.fromhex(t.key))
        counted = Counted(ident, ancestors, t.prefix_tokens, t.count, t.conversations, order)
        out.append((counted, t))
    return out


def _plus(a: MinedTemplate, b: MinedTemplate) -> MinedTemplate:
    return replace(a, count=a.count + b.count, conversations=a.conversations + b.conversations)


def fetch_templates(
    urls: Sequence[str], token: str, top: int, timeout_s: float = 10.0
) -> list[MinedTemplate]:
    """The top ``top`` templates of several servers, merged (see the module contract).

    Args:
        urls: the servers' base URLs, e.g. ``http://10.0.0.5:8000``.
        token: their gateway secret (``X-Dscache-Gateway-Token``).
        top: templates asked of each server and returned (1 to :data:`MAX_TOP`).
        timeout_s: per server.

    Raises:
        ValueError: ``top`` out of range, no URL, or every server failed.
    """
    if not 1 <= top <= MAX_TOP:
        raise ValueError(f"top must be 1 to {MAX_TOP}, got {top}")
    if not urls:
        raise ValueError("no server to fetch templates from")
    lists = []
    with httpx.Client(timeout=timeout_s) as client:
        for url in urls:
            try:
                lists.append(_fetch_one(client, url, token, top))
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("templates of %s skipped: %s", url, exc)
    if not lists:
        raise ValueError(f"none of the {len(urls)} servers listed its templates")
    return merge(lists, top)


def _fetch_one(client: httpx.Client, url: str, token: str, top: int) -> list[MinedTemplate]:
    r = client.get(
        url.rstrip("/") + TEMPLATES_PATH,
        params={"top": top},
        headers={GATEWAY_TOKEN_HEADER: token},
    )
    r.raise_for_status()
    body = r.json()  # a body that is not JSON raises ValueError
    templates = body.get("templates") if isinstance(body, dict) else None
    if not isinstance(templates, list):
        raise ValueError("the answer has no templates list")
    return [MinedTemplate.from_dict(t) for t in templates]
