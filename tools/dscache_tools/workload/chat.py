"""A chat-like workload: many short turns, no shared documents.

The finance workload is long shared filings plus follow-ups; real chat traffic is
mostly the opposite: a short system prompt and turns of a few dozen words, so most
prompts stay under a thousand tokens and grow by a hundred or so per turn. This is
where a fixed admission threshold loses the most: every prompt under it is neither
loaded nor stored.

Contract:
    * ``chat_workload(...)`` is a pure function of its arguments (one seeded
      generator), in the finance workload's format (:class:`ChatRequest`), so
      ``dscache load`` and the benches replay it unchanged.
    * Turn ``t`` sends turn ``t-1``'s messages, its canned answer and one new
      question (an exact prefix, as in the finance workload); a request carries
      its session id unless drawn into ``drop_id_share`` (per request, from a
      generator of its own, so the conversations do not change with the share;
      ``company`` is ``"chat"``, ``lang`` ``"en"``). ``dscache workload chat``
      writes it.
"""

from __future__ import annotations

import random

from dscache_tools.workload.model import ChatRequest

_WORDS = [
    "the",
    "a",
    "we",
    "it",
    "this",
    "that",
    "plan",
    "team",
    "week",
    "data",
    "model",
    "trip",
    "book",
    "idea",
    "code",
    "test",
    "draft",
    "note",
    "list",
    "email",
    "budget",
    "meeting",
    "garden",
    "recipe",
    "bug",
    "release",
    "review",
    "question",
    "answer",
    "later",
    "today",
    "maybe",
    "better",
    "simple",
    "quick",
    "careful",
    "long",
    "short",
    "new",
    "old",
    "first",
    "next",
    "write",
    "read",
    "fix",
    "check",
    "move",
    "keep",
    "change",
    "start",
    "finish",
    "explain",
    "compare",
    "summarize",
    "travel",
    "dinner",
    "project",
    "report",
    "customer",
    "order",
    "invoice",
    "schedule",
    "lesson",
    "music",
    "because",
    "although",
    "while",
    "after",
    "before",
    "since",
    "until",
    "and",
    "but",
    "or",
    "so",
    "if",
    "then",
]

SYSTEM = "You are a helpful assistant. Answer briefly and ask when something is unclear."


def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def _text(rng: random.Random, lo: int, hi: int) -> str:
    total = rng.randint(lo, hi)
    parts: list[str] = []
    while total > 0:
        n = min(total, rng.randint(6, 14))
        parts.append(_sentence(rng, n))
        total -= n
    return " ".join(parts)


def chat_workload(
    sessions: int,
    *,
    seed: int = 0,
    min_turns: int = 4,
    max_turns: int = 10,
    user_words: tuple[int, int] = (15, 50),
    answer_words: tuple[int, int] = (30, 80),
    max_tokens: int = 16,
    drop_id_share: float = 0.0,
) -> list[ChatRequest]:
    """``sessions`` conversations of ``min_turns..max_turns`` short turns each.

    ``drop_id_share``: the share of requests sent without their session id (drawn
    per request, as a gateway that loses the header now and then).
    """
    if sessions < 1:
        raise ValueError("sessions must be >= 1")
    if not 0.0 <= drop_id_share <= 1.0:
        raise ValueError("drop_id_share must be in [0, 1]")
    drops = random.Random(f"chat/{seed}/drops")
    if not 1 <= min_turns <= max_turns:
        raise ValueError("need 1 <= min_turns <= max_turns")
    rng = random.Random(f"chat/{seed}")
    out: list[ChatRequest] = []
    for s in range(sessions):
        session = f"chat-{seed}-{s}"
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        for turn in range(rng.randint(min_turns, max_turns)):
            messages.append({"role": "user", "content": _text(rng, *user_words)})
            out.append(
                ChatRequest(
                    session=session,
                    turn=turn,
                    company="chat",
                    lang="en",
                    session_id=None if drops.random() < drop_id_share else session,
                    reconnected=False,
                    messages=list(messages),
                    max_tokens=max_tokens,
                )
            )
            messages.append({"role": "assistant", "content": _text(rng, *answer_words)})
    return out
