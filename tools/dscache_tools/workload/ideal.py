"""The ideal token hit ratio of a workload, and the server's tokenizer to count it with.

The ideal token hit ratio is what an infinite prefix cache of ``block_tokens``
blocks could reuse: every full block whose chained key was seen in an earlier
request is a hit. Only the set of distinct block keys matters, so the figure does
not depend on the order in which sessions interleave (as long as each session's
turns stay in order).

Contract:
    * Block keys come from ``dscache.keys`` (the contract), so two prompts share a
      block exactly when the server would.
    * The model server's tokenizer is imported only by :func:`load_server_tokenizer`
      and :func:`prompt_ids` (the 'server' extra); the rest of the workload
      package needs no model code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dscache_tools.workload.model import ChatRequest


class ChatTokenizer(Protocol):
    """What the ideal-hit computation needs: the server's chat template."""

    def apply_chat_template(
        self, messages: Sequence[Any], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a rendered conversation."""
        ...


@dataclass(frozen=True)
class IdealHit:
    """What an infinite prefix cache of full blocks could reuse.

    Attributes:
        requests: requests counted.
        prompt_tokens: prompt tokens over all of them.
        hit_tokens: tokens in full blocks seen in an earlier request.
        token_hit_ratio: hit_tokens / prompt_tokens.
        mean_prompt_tokens: average prompt length.
        max_prompt_tokens: longest prompt.
    """

    requests: int
    prompt_tokens: int
    hit_tokens: int
    token_hit_ratio: float
    mean_prompt_tokens: float
    max_prompt_tokens: int


def load_server_tokenizer() -> ChatTokenizer:
    """The model server's DeepSeek tokenizer and chat template (the 'server' extra)."""
    try:
        from dscache_server.tokenizer import DeepSeekTokenizer
    except ModuleNotFoundError as exc:
        raise RuntimeError(
            "counting prompt tokens needs the model server's tokenizer: "
            f"pip install 'dscache[server]' ({exc})"
        ) from exc

    class _Memo(DeepSeekTokenizer):
        """The server's tokenizer with plain-text encodings memoised.

        The template encodes message by message, and a workload repeats each
        message in every later turn of its session, so this turns quadratic work
        into linear work without touching the template itself.
        """

        def __init__(self) -> None:
            super().__init__()
            self._memo: dict[str, list[int]] = {}

        def encode(self, text: str) -> list[int]:
            ids = self._memo.get(text)
            if ids is None:
                ids = super().encode(text)
                self._memo[text] = ids
            return list(ids)

    return _Memo()


def prompt_ids(tokenizer: ChatTokenizer, request: ChatRequest) -> list[int]:
    """Token ids the server prefills for ``request`` (its chat template)."""
    from dscache_server.tokenizer import ChatMessage

    return tokenizer.apply_chat_template(
        [ChatMessage(m["role"], m["content"]) for m in request.messages]
    )


def ideal_hit_ratio(
    requests: Iterable[ChatRequest],
    tokenizer: ChatTokenizer,
    *,
    block_tokens: int = 256,
    min_tokens: int = 0,
    warm: Iterable[ChatRequest] = (),
) -> IdealHit:
    """Infinite-cache, prefix-semantics token hit ratio of ``requests``.

    Block keys come from ``dscache.keys`` (the contract), so two prompts share a
    block exactly when the server would. Prompts shorter than ``min_tokens`` are
    neither cached nor counted as hits (the server's admission threshold).
    ``warm`` requests fill the cache first and are not counted (a prewarm).
    """
    from dscache.keys import KeyChain, KVLayout, LayoutKind, ModelFingerprint

    layout = KVLayout(
        LayoutKind.GQA, num_layers=1, dtype="float32", num_kv_heads=1, head_dim=1, v_head_dim=1
    )
    chain = KeyChain(ModelFingerprint("ideal", "0", layout, block_tokens=block_tokens), b"")
    seen: set[bytes] = set()
    for r in warm:
        seen.update(chain.keys(prompt_ids(tokenizer, r)))
    n = total = hit = longest = 0
    for r in requests:
        ids = prompt_ids(tokenizer, r)
        n += 1
        total += len(ids)
        longest = max(longest, len(ids))
        if len(ids) < min_tokens:
            continue
        keys = chain.keys(ids)
        leading = 0
        for k in keys:
            if k not in seen:
                break
            leading += 1
        # The server always recomputes the last prompt token (it needs its logits).
        hit += min(leading * block_tokens, len(ids) - 1)
        seen.update(keys)
    return IdealHit(
        requests=n,
        prompt_tokens=total,
        hit_tokens=hit,
        token_hit_ratio=hit / total if total else 0.0,
        mean_prompt_tokens=total / n if n else 0.0,
        max_prompt_tokens=longest,
    )
