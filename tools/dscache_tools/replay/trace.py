"""Trace readers for ``dscache replay``: JSONL request traces into chained block ids.

Contract:

* One request per line, in either format (detected per line; blank lines are
  skipped):

  - Mooncake: ``{"timestamp", "input_length", "output_length", "hash_ids"}``,
    512-token blocks, ``len(hash_ids) == ceil(input_length / 512)``; every
    block holds 512 tokens except the last, which holds
    ``input_length - 512 * (len(hash_ids) - 1)``.
  - dscache request log: ``{"block_keys": [hex, ...], "prompt_tokens": int,
    "block_tokens": int}`` and an optional ``"timestamp"`` (milliseconds); every
    key is a full block; tokens past the last full block count in the
    denominator only (they are never cached).

  A request's time (``time_s``) is its timestamp, or one second after the
  previous request's when the line has none (time-aware policies read it).

  Keys are chained ids (a key names its whole prefix), so a block's parent is
  the block before it in any request that holds it.
* A line that is not a request of a known shape is a :class:`TraceError` naming
  the file and line.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Tokens per block in Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """The trace cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request: its chained block ids and how many tokens each block holds.

    Attributes:
        blocks: interned block ids, root first.
        block_tokens: tokens in every block but the last.
        last_tokens: tokens in the last block (``block_tokens`` if it is full).
        prompt_tokens: all input tokens of the request (the ratio's denominator).
        time_s: when it arrived, seconds (see the module's contract).
    """

    blocks: list[int]
    block_tokens: int
    last_tokens: int
    prompt_tokens: int
    time_s: float = 0.0

    @property
    def last_full(self) -> int:
        """Index of the last full block (-1 when there is none)."""
        return len(self.blocks) - (1 if self.last_tokens < self.block_tokens else 0) - 1

    def prefix_tokens(self, n_blocks: int) -> int:
        """Tokens in the first ``n_blocks`` blocks."""
        if n_blocks <= 0:
            return 0
        if n_blocks >= len(self.blocks):
            return (len(self.blocks) - 1) * self.block_tokens + self.last_tokens
        return n_blocks * self.block_tokens


@dataclass
class Trace:
    """A parsed trace plus the structure the simulators need.

    Attributes:
        path: where it came from (for reports).
        requests: the requests in order.
        children: block id -> ids of the blocks that follow it in some request.
    """

    path: str
    requests: list[Request]
    children: dict[int, list[int]] = field(default_factory=dict)
    _next_use: list[list[int]] | None = field(default=None, repr=False)

    @property
    def total_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def total_blocks(self) -> int:
        return sum(len(r.blocks) for r in self.requests)

    def next_use(self) -> list[list[int]]:
        """For each request and block position, the index of the next request using
        that block (``len(requests)`` if none)."""
        if self._next_use is None:
            never = len(self.requests)
            last: dict[int, int] = {}
            out: list[list[int]] = [[] for _ in self.requests]
            for t in range(len(self.requests) - 1, -1, -1):
                blocks = self.requests[t].blocks
                row = [last.get(b, never) for b in blocks]
                for b in blocks:
                    last[b] = t
                out[t] = row
            self._next_use = out
        return self._next_use


def build_trace(path: str, requests: list[Request]) -> Trace:
    """Wraps parsed requests with their parent -> children map."""
    children: dict[int, list[int]] = {}
    edges: set[tuple[int, int]] = set()
    for req in requests:
        blocks = req.blocks
        for i in range(1, len(blocks)):
            edge = (blocks[i - 1], blocks[i])
            if edge not in edges:
                edges.add(edge)
                children.setdefault(edge[0], []).append(edge[1])
    return Trace(path=path, requests=requests, children=children)


def parse_trace(lines: Iterable[str], source: str) -> list[Request]:
    """Parses JSONL trace lines (either format) into requests.

    Raises:
        TraceError: on a line that is not JSON or not a request of a known shape.
    """
    intern: dict[object, int] = {}
    requests: list[Request] = []
    last_time = -1.0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if "hash_ids" in obj:
            req = _mooncake_request(obj, intern, where)
        elif "block_keys" in obj:
            req = _dscache_request(obj, intern, where)
        else:
            raise TraceError(
                f"{where}: neither a Mooncake record (hash_ids) nor a dscache "
                "request log record (block_keys)"
            )
        if "timestamp" in obj:
            stamp = obj["timestamp"]
            if not isinstance(stamp, int | float) or isinstance(stamp, bool) or stamp < 0:
                raise TraceError(f"{where}: 'timestamp' must be a number >= 0 (ms), got {stamp!r}")
            last_time = stamp / 1000.0
        else:
            last_time += 1.0
        requests.append(dataclasses.replace(req, time_s=max(last_time, 0.0)))
    return requests


def _int_field(obj: dict[str, Any], name: str, where: str, minimum: int) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(f"{where}: {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _mooncake_request(obj: dict[str, Any], intern: dict[object, int], where: str) -> Request:
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    input_length = _int_field(obj, "input_length", where, 0)
    expected = math.ceil(input_length / MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length} "
            f"(expected ceil({input_length}/{MOONCAKE_BLOCK_TOKENS}) = {expected})"
        )
    blocks = [intern.setdefault(h, len(intern)) for h in hash_ids]
    last = input_length - MOONCAKE_BLOCK_TOKENS * (len(blocks) - 1) if blocks else 0
    return Request(blocks, MOONCAKE_BLOCK_TOKENS, last, input_length)


def _dscache_request(obj: dict[str, Any], intern: dict[object, int], where: str) -> Request:
    keys = obj["block_keys"]
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise TraceError(f"{where}: 'block_keys' must be a list of hex strings")
    block_tokens = _int_field(obj, "block_tokens", where, 1)
    prompt_tokens = _int_field(obj, "prompt_tokens", where, 0)
    if len(keys) * block_tokens > prompt_tokens:
        raise TraceError(
            f"{where}: {len(keys)} blocks of {block_tokens} tokens exceed "
            f"prompt_tokens {prompt_tokens}"
        )
    # The "s:" tag keeps string keys apart from Mooncake's integer ids.
    blocks = [intern.setdefault("s:" + k, len(intern)) for k in keys]
    return Request(blocks, block_tokens, block_tokens, prompt_tokens)


def load_trace(path: str | Path) -> Trace:
    """Reads and parses a trace file.

    Raises:
        TraceError: if the file cannot be read or a line is malformed.
    """
    source = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            requests = parse_trace(f, source)
    except OSError as exc:
        raise TraceError(f"cannot read trace {source}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"cannot read trace {source}: not UTF-8 text ({exc.reason})") from None
    return build_trace(source, requests)
