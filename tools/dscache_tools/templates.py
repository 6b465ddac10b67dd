"""Prewarm templates mined from captured chat requests (``dscache templates``).

A template is a block-aligned prompt prefix that several requests start with: a
system prompt, a company dossier, a shared first question. Mining tokenizes each
request with the model server's chat template, cuts it into chained block keys
(:func:`dscache.keys.block_keys`) and counts, per key, how many requests start
with that prefix. Prewarming a template once saves ``count - 1`` prefills of it.

Contract:
    * Token ids come from the server's tokenizer and chat template, and keys from
      ``dscache.keys``, so a template's blocks are exactly the blocks the server
      would store for its requests (under any one root: mining uses a fixed root,
      :data:`DEFAULT_ROOT`, since only equality of keys matters).
    * A template is a prefix of at least ``min_count`` requests from at least
      ``min_conversations`` conversations. A prefix only one conversation shares
      is that conversation's own history, which the cache keeps anyway, and which
      no new conversation will send: it is not a template. Records without a
      conversation (prompt logs) each count as their own conversation.
    * Only maximal templates are listed: a prefix is dropped when a longer one is
      shared by as many requests (it adds nothing the longer one does not cover).
    * ``saved_tokens`` of a template is ``(count - 1) x`` the tokens it adds to
      its nearest listed shorter template (all its tokens when there is none), so
      the templates' savings add up without counting a shared block twice, and
      ``coverage`` (their sum over all prompt tokens) is what caching the listed
      templates once saves; a lower bound when a shorter template was cut by
      ``top``. Templates are ranked by ``saved_tokens``, most first.
    * These rules (eligible, maximal, saved tokens, ranking) are
      :mod:`dscache_server.templaterank`'s, which the model server's live miner
      (:mod:`dscache_server.templatelog`) shares.
    * Each template carries the shortest message prefix of a request it came from
      whose rendering (generation prompt included, as the chat API sends it)
      starts with the template's tokens, so ``dscache prewarm`` can replay it:
      the server stores the full blocks, which are the template's blocks.
    * The Bloom filter of templates is the sidecar's holdings format
      (:class:`dscache_sidecar.holdings.HoldingsFilter`) over every block key of
      every template, under a root given by the caller.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dscache_server.templaterank import Counted, select

from dscache.keys import KEY_BYTES, block_keys
from dscache_tools.workload import ChatTokenizer, read_jsonl

if TYPE_CHECKING:
    from dscache_sidecar.holdings import HoldingsFilter

#: The chain root mining uses when none is given: any fixed root will do.
DEFAULT_ROOT = hashlib.sha256(b"templates").digest()

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Chat:
    """One captured request.

    Attributes:
        messages: its OpenAI chat messages.
        conversation: the conversation it belongs to; None when unknown (each such
            request is its own conversation).
    """

    messages: Messages
    conversation: str | None = None


@dataclass(frozen=True)
class MineOptions:
    """What counts as a template.

    Attributes:
        top: templates kept, most valuable first.
        block_tokens: tokens per block (the server's ``--block-tokens``).
        min_count: requests that must start with a prefix.
        min_conversations: distinct conversations those requests must come from.
    """

    top: int = 100
    block_tokens: int = 256
    min_count: int = 2
    min_conversations: int = 2

    def __post_init__(self) -> None:
        if self.top < 1:
            raise ValueError("top must be at least 1")
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        if self.min_count < 2:
            raise ValueError("min_count must be at least 2 (a prefix nobody shares saves nothing)")
        if self.min_conversations < 1:
            raise ValueError("min_conversations must be at least 1")


@dataclass(frozen=True)
class Template:
    """One mined template.

    Attributes:
        ids: its token ids (a whole number of blocks).
        count: requests that start with it.
        conversations: distinct conversations among them.
        saved_tokens: prefill tokens caching it once saves (see the module contract).
        messages: the message prefix that replays it through the chat API.
    """

    ids: tuple[int, ...]
    count: int
    conversations: int
    saved_tokens: int
    messages: Messages

    def blocks(self, block_tokens: int) -> int:
        """Blocks it spans."""
        return len(self.ids) // block_tokens

    def keys(self, root: bytes, block_tokens: int) -> list[bytes]:
        """Its chained block keys under ``root``."""
        return block_keys(root, self.ids, block_tokens)


@dataclass(frozen=True)
class Mined:
    """Templates of a set of requests, and what they save.

    Attributes:
        templates: ranked, most saved tokens first.
        requests: requests mined.
        total_prompt_tokens: their prompt tokens.
        block_tokens: tokens per block.
    """

    templates: list[Template]
    requests: int
    total_prompt_tokens: int
    block_tokens: int

    @property
    def coverage(self) -> float:
        """Share of all prompt tokens that caching the templates once saves."""
        saved = sum(t.saved_tokens for t in self.templates)
        return saved / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON report (``--json``)."""
        return {
            "templates": [
                {
                    "tokens": len(t.ids),
                    "blocks": t.blocks(self.block_tokens),
                    "count": t.count,
                    "conversations": t.conversations,
                    "saved_tokens": t.saved_tokens,
                    "messages": t.messages,
                }
                for t in self.templates
            ],
            "requests": self.requests,
            "total_prompt_tokens": self.total_prompt_tokens,
            "block_tokens": self.block_tokens,
            "coverage": self.coverage,
        }

    def prompts_jsonl(self) -> str:
        """The templates as ``dscache prewarm`` prompts, one chat per line, best first."""
        return "".join(
            json.dumps({"messages": t.messages}, ensure_ascii=False) + "\n" for t in self.templates
        )

    def keys(self, root: bytes = DEFAULT_ROOT) -> list[bytes]:
        """Every distinct block key of every template under ``root``, in template order."""
        out: dict[bytes, None] = {}
        for t in self.templates:
            out.update(dict.fromkeys(t.keys(root, self.block_tokens)))
        return list(out)


def read_chats(workloads: Sequence[Path] = (), logs: Sequence[Path] = ()) -> list[Chat]:
    """Requests from workload files (``dscache workload``) and prompt logs.

    A prompt log is JSONL of ``{"messages": [...]}`` records (or bare message
    lists), read by the prewarm's own reader; its records carry no conversation.

    Raises:
        ValueError: a malformed line (named with its file and line number).
        OSError: a file that cannot be read.
    """
    from dscache_server.prewarm import read_prompts

    chats = [Chat(r.messages, r.session) for path in workloads for r in read_jsonl(path)]
    for path in logs:
        for n, messages in enumerate(read_prompts(path), start=1):
            try:
                chats.append(Chat([_flat(m) for m in messages]))
            except (AttributeError, TypeError, KeyError, ValueError) as exc:
                raise ValueError(f"{path}: record {n}: {exc!r}") from None
    return chats


def _flat(message: dict[str, Any]) -> dict[str, str]:
    """A logged message with its content as the server flattens it: text parts joined.

    (``dscache_server.schemas.ChatMessageIn.text``, not imported: it loads torch.)
    """
    role, content = message["role"], message.get("content")
    if not isinstance(role, str):
        raise ValueError(f"role {role!r} is not a string")
    if content is None or isinstance(content, str):
        return {"role": role, "content": content or ""}
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"unsupported content part {part.get('type')!r}")
        parts.append(part["text"])
    return {"role": role, "content": "".join(parts)}


def chat_ids(
    tokenizer: ChatTokenizer, messages: Sequence[dict[str, str]], *, generation: bool = True
) -> list[int]:
    """Token ids the server prefills for ``messages`` (its chat template)."""
    from dscache_server.tokenizer import ChatMessage

    return tokenizer.apply_chat_template(
        [ChatMessage(m["role"], m["content"]) for m in messages],
        add_generation_prompt=generation,
    )


@dataclass
class _Node:
    """One block-aligned prefix: the requests that start with it."""

    depth: int  # blocks
    parent: bytes | None
    first: int  # index of the first request with it
    count: int = 0
    conversations: set[str] = field(default_factory=set)


def mine(
    chats: Sequence[Chat],
    tokenizer: ChatTokenizer,
    options: MineOptions | None = None,
    *,
    root: bytes = DEFAULT_ROOT,
) -> Mined:
    """The top templates of ``chats`` (see the module contract).

    The rules (eligible, maximal, saved tokens, ranking) are
    :func:`dscache_server.templaterank.select`'s, which the server's live miner
    shares.
    """
    opts = options or MineOptions()
    bt = opts.block_tokens
    ids_of = [chat_ids(tokenizer, c.messages) for c in chats]
    nodes: dict[bytes, _Node] = {}
    for i, (chat, ids) in enumerate(zip(chats, ids_of, strict=True)):
        conversation = chat.conversation if chat.conversation is not None else f"\0{i}"
        parent: bytes | None = None
        for depth, key in enumerate(block_keys(root, ids, bt), start=1):
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = _Node(depth, parent, i)
            node.count += 1
            node.conversations.add(conversation)
            parent = key
    ranked = select(
        (_counted(nodes, key, bt) for key in nodes),
        opts.top,
        min_count=opts.min_count,
        min_conversations=opts.min_conversations,
    )
    templates = []
    for r in ranked:
        node = nodes[r.prefix.key]
        ids = ids_of[node.first][: node.depth * bt]
        templates.append(
            Template(
                ids=tuple(ids),
                count=node.count,
                conversations=len(node.conversations),
                saved_tokens=r.saved_tokens,
                messages=_replay(tokenizer, chats[node.first].messages, ids),
            )
        )
    return Mined(templates, len(chats), sum(len(ids) for ids in ids_of), bt)


def _counted(nodes: dict[bytes, _Node], key: bytes, bt: int) -> Counted:
    node = nodes[key]
    ancestors = []
    up = node.parent
    while up is not None:
        ancestors.append(up)
        up = nodes[up].parent
    return Counted(
        key=key,
        ancestors=tuple(ancestors),
        tokens=node.depth * bt,
        count=node.count,
        conversations=len(node.conversations),
        order=node.first,
    )


def _replay(tokenizer: ChatTokenizer, messages: Messages, ids: Sequence[int]) -> Messages:
    """The fewest leading messages whose rendering starts with ``ids``.

    A template usually ends inside a message; the message is kept whole (the
    server stores only full blocks, which are the template's). The whole request
    always qualifies: its rendering starts with its own ids.
    """
    want = list(ids)
    for k in range(1, len(messages)):
        head = messages[:k]
        # Cheap test first: without the generation prompt the rendering must
        # already reach all but one of the template's tokens.
        if len(chat_ids(tokenizer, head, generation=False)) + 1 < len(want):
            continue
        if chat_ids(tokenizer, head)[: len(want)] == want:
            return [dict(m) for m in head]
    return [dict(m) for m in messages]


def template_filter(mined: Mined, root: bytes = DEFAULT_ROOT) -> HoldingsFilter:
    """A holdings-format Bloom filter of every template block key under ``root``."""
    from dscache_sidecar.holdings import HoldingsFilter

    keys = mined.keys(root)
    return HoldingsFilter.of(keys, capacity=max(len(keys), 1))


@dataclass(frozen=True)
class MatchReport:
    """How much of a set of requests a template filter recognises.

    Attributes:
        requests: requests checked.
        first_block_matches: requests whose first block is a template block.
        prompt_tokens: their prompt tokens.
        matched_tokens: tokens in each request's leading run of template blocks.
    """

    requests: int
    first_block_matches: int
    prompt_tokens: int
    matched_tokens: int

    def to_dict(self) -> dict[str, Any]:
        """The JSON report (``--json``)."""
        return {
            "requests": self.requests,
            "first_block_matches": self.first_block_matches,
            "match_share": self.first_block_matches / self.requests if self.requests else 0.0,
            "prompt_tokens": self.prompt_tokens,
            "matched_tokens": self.matched_tokens,
            "matched_token_share": (
                self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
            ),
        }


def match(
    chats: Sequence[Chat],
    tokenizer: ChatTokenizer,
    templates: HoldingsFilter,
    *,
    root: bytes = DEFAULT_ROOT,
    block_tokens: int = 256,
) -> MatchReport:
    """Checks each request's block keys against a template filter.

    A Bloom filter answers "maybe": a first block counted as a match may, with the
    filter's false-positive rate, be none.
    """
    first = total = matched = 0
    for chat in chats:
        ids = chat_ids(tokenizer, chat.messages)
        keys = block_keys(root, ids, block_tokens)
        held = templates.prefix_length(keys)
        total += len(ids)
        matched += held * block_tokens
        first += held > 0
    return MatchReport(len(chats), first, total, matched)


def parse_root(text: str | None) -> bytes:
    """``--root-hex``: 64 hex digits, or the default root when None.

    Raises:
        ValueError: not 32 bytes of hex.
    """
    if text is None:
        return DEFAULT_ROOT
    try:
        root = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"--root-hex {text!r} is not hex") from None
    if len(root) != KEY_BYTES:
        raise ValueError(f"--root-hex must be {KEY_BYTES} bytes ({2 * KEY_BYTES} hex digits)")
    return root


def table(mined: Mined) -> str:
    """The human-readable ranking."""
    bt = mined.block_tokens
    lines = [
        f"{mined.requests} requests, {mined.total_prompt_tokens} prompt tokens, "
        f"{len(mined.templates)} templates of {bt}-token blocks save "
        f"{sum(t.saved_tokens for t in mined.templates)} tokens "
        f"(coverage {mined.coverage:.3f})",
        f"{'#':>3} {'tokens':>7} {'blocks':>6} {'count':>6} {'convs':>6} {'saved':>9} "
        f"{'msgs':>4}  ends in",
    ]
    for n, t in enumerate(mined.templates, start=1):
        last = t.messages[-1]
        snippet = " ".join(last["content"].split())[:40]
        lines.append(
            f"{n:>3} {len(t.ids):>7} {t.blocks(bt):>6} {t.count:>6} {t.conversations:>6} "
            f"{t.saved_tokens:>9} {len(t.messages):>4}  {last['role']}: {snippet}"
        )
    return "\n".join(lines)
