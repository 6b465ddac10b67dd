"""Which shared prompt prefixes are worth prewarming: the ranking rules of mined templates.

Pure functions over counted prefixes, shared by the live miner
(:mod:`dscache_server.templatelog`) and the offline one (``dscache templates
mine``), so both list the same templates for the same requests.

Contract:
    * A prefix is a block-aligned prompt prefix named by its chained block key
      (:mod:`dscache.keys`); ``ancestors`` are the keys of its shorter block-aligned
      prefixes, nearest first. Ancestors the caller no longer knows may be left out.
    * Eligible: ``count >= min_count`` and ``conversations >= min_conversations``. A
      prefix only one conversation shares is that conversation's own history.
    * Maximal only: an eligible prefix is dropped when an eligible longer prefix of
      its chain has as many requests, to within the prefix's count error
      (``count - error <= that count``): it adds nothing the longer one does not
      cover. Exact counts have ``error`` 0.
    * ``saved_tokens`` is ``(count - 1) x`` the tokens a prefix adds to its nearest
      listed ancestor (all its tokens when none is listed), so the savings of the
      listed templates add up without counting a shared block twice.
    * Ranked by saved tokens, most first; ties: longer, seen earlier (``order``),
      then key. The top ``n`` are kept, then their savings are recounted against the
      ancestors actually kept (a dropped ancestor's tokens count for its
      descendants).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Counted:
    """One block-aligned prefix and how many requests start with it.

    Attributes:
        key: its chained block key (the last block's).
        ancestors: keys of its shorter block-aligned prefixes, nearest first.
        tokens: its length in tokens.
        count: requests that start with it (may overestimate by up to ``error``).
        conversations: distinct conversations among them.
        order: when it was first seen (smaller = earlier), for stable ties.
        error: most by which ``count`` may overestimate (0 when exact).
    """

    key: bytes
    ancestors: tuple[bytes, ...]
    tokens: int
    count: int
    conversations: int
    order: int = 0
    error: int = 0


@dataclass(frozen=True)
class Ranked:
    """A listed template: the prefix and what caching it once saves."""

    prefix: Counted
    saved_tokens: int


def select(
    prefixes: Iterable[Counted], top: int, *, min_count: int = 2, min_conversations: int = 2
) -> list[Ranked]:
    """The top ``top`` templates among ``prefixes``, best first (see the module contract)."""
    candidates = maximal(prefixes, min_count=min_count, min_conversations=min_conversations)
    chosen = _ranked(candidates, set(candidates))[:top]
    kept = {p.key: p for p in chosen}
    listed = set(kept)
    return [Ranked(p, saved(p, kept, listed)) for p in _ranked(kept, listed)]


def maximal(
    prefixes: Iterable[Counted], *, min_count: int, min_conversations: int
) -> dict[bytes, Counted]:
    """The eligible prefixes no longer eligible prefix covers, by key."""
    eligible = {
        p.key: p for p in prefixes if p.count >= min_count and p.conversations >= min_conversations
    }
    deepest: dict[bytes, int] = {}  # key -> most requests of an eligible longer prefix
    for p in eligible.values():
        for up in p.ancestors:
            if up in eligible:
                deepest[up] = max(deepest.get(up, 0), p.count)
    return {k: p for k, p in eligible.items() if k not in deepest or p.count - p.error > deepest[k]}


def saved(prefix: Counted, known: Mapping[bytes, Counted], listed: set[bytes]) -> int:
    """``(count - 1) x`` the tokens ``prefix`` adds to its nearest listed ancestor."""
    up = next((a for a in prefix.ancestors if a in listed), None)
    base = known[up].tokens if up is not None else 0
    return (prefix.count - 1) * (prefix.tokens - base)


def _ranked(known: Mapping[bytes, Counted], listed: set[bytes]) -> list[Counted]:
    return sorted(
        known.values(),
        key=lambda p: (-saved(p, known, listed), -p.tokens, p.order, p.key),
    )
