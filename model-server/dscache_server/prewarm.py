"""``dscache prewarm``: send prompts to a server so their prefixes get stored.

Each line of the prompts file is one chat: ``{"messages": [...]}`` or a bare list
of messages. Every chat is sent as a one-token completion (the prefill stores the
prompt's full blocks in the background). Failures are counted and reported; the
command exits non-zero only when nothing succeeded.
"""

from __future__ import annotations

import argparse
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

log = logging.getLogger(__name__)


@dataclass
class PrewarmResult:
    """Totals of one prewarm run."""

    sent: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


def read_prompts(path: Path) -> list[list[dict[str, Any]]]:
    """Chats from a JSONL file; raises ValueError naming the bad line."""
    chats: list[list[dict[str, Any]]] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON: {exc}") from None
        messages = obj.get("messages") if isinstance(obj, dict) else obj
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{path}:{n}: expected a list of messages")
        chats.append(messages)
    return chats


def prewarm(
    target: str,
    chats: list[list[dict[str, Any]]],
    *,
    headers: dict[str, str] | None = None,
    concurrency: int = 1,
    timeout_s: float = 300.0,
    model: str | None = None,
    progress: bool = True,
) -> PrewarmResult:
    """Sends every chat once; returns totals."""
    result = PrewarmResult()
    url = target.rstrip("/") + "/v1/chat/completions"
    with httpx.Client(timeout=timeout_s, headers=headers or {}) as client:

        def send(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
            body: dict[str, Any] = {"messages": messages, "max_tokens": 1, "temperature": 0}
            if model:
                body["model"] = model
            try:
                resp = client.post(url, json=body)
            except httpx.HTTPError as exc:
                log.warning("prewarm request failed: %s", exc)
                return None
            if resp.status_code != 200:
                log.warning("prewarm request got %d: %s", resp.status_code, resp.text[:200])
                return None
            data: dict[str, Any] = resp.json()
            return data

        with ThreadPoolExecutor(max_workers=max(concurrency, 1)) as pool:
            bar = tqdm(total=len(chats), desc="prewarm", unit="prompt", disable=not progress)
            for data in pool.map(send, chats):
                bar.update(1)
                if data is None:
                    result.failed += 1
                    continue
                result.sent += 1
                usage = data.get("usage", {})
                result.prompt_tokens += int(usage.get("prompt_tokens", 0))
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens += int(details.get("cached_tokens", 0))
            bar.close()
    return result


def run_cli(args: argparse.Namespace) -> int:
    """Entry point of ``dscache prewarm``."""
    try:
        chats = read_prompts(Path(args.prompts))
    except (OSError, ValueError) as exc:
        log.error("cannot read prompts: %s", exc)
        return 2
    headers: dict[str, str] = {}
    if args.tenant:
        headers["X-Dscache-Tenant"] = args.tenant
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    result = prewarm(
        args.target,
        chats,
        headers=headers,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        model=args.model,
        progress=True,
    )
    print(
        f"prewarm: {result.sent} sent, {result.failed} failed, "
        f"{result.prompt_tokens} prompt tokens, {result.cached_tokens} already cached"
    )
    return 0 if result.sent or not chats else 1
