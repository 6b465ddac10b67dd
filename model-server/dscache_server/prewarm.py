"""``dscache prewarm``: send prompts to servers so their prefixes get stored.

Each line of the prompts file is one chat: ``{"messages": [...]}`` or a bare list
of messages. Every chat is sent as a one-token completion (the prefill stores the
prompt's full blocks in the background).

Several targets (``--target`` repeated and/or comma-separated) are the pods of
one track: each pod has its own KV store and the router may send a session to
any of them, so every prompt goes to every target, all targets at once, with
``--concurrency`` requests in flight per target. Failures are counted and
reported per target; the command exits non-zero when any target had prompts to
take and took none (a pod that cannot be warmed is worth a failed Job), and
with 2 when the prompts cannot be read.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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

    def add(self, usage: dict[str, Any] | None) -> None:
        """Counts one answer's ``usage``, or a failure (None)."""
        if usage is None:
            self.failed += 1
            return
        self.sent += 1
        self.prompt_tokens += int(usage.get("prompt_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens += int(details.get("cached_tokens", 0))


@dataclass(frozen=True)
class PrewarmOptions:
    """How prompts are sent.

    Attributes:
        headers: extra request headers (tenant, API key).
        concurrency: requests in flight per target.
        timeout_s: seconds per request.
        model: model name to send (default: the server's).
    """

    headers: dict[str, str] = field(default_factory=dict)
    concurrency: int = 1
    timeout_s: float = 300.0
    model: str | None = None

    def body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The request body of one chat: a one-token greedy completion."""
        body: dict[str, Any] = {"messages": messages, "max_tokens": 1, "temperature": 0}
        if self.model:
            body["model"] = self.model
        return body


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


def parse_targets(values: list[str]) -> list[str]:
    """``--target`` values (each may hold several, comma-separated) -> distinct URLs, in order.

    Raises:
        ValueError: no target, or one that is not an http(s) URL.
    """
    out: list[str] = []
    for value in values:
        for part in value.split(","):
            url = part.strip().rstrip("/")
            if not url:
                continue
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"target {url!r} is not an http:// or https:// URL")
            if url not in out:
                out.append(url)
    if not out:
        raise ValueError("no target given")
    return out


def prewarm(
    target: str,
    chats: list[list[dict[str, Any]]],
    options: PrewarmOptions | None = None,
    *,
    progress: bool = True,
    on_sent: Callable[[], None] | None = None,
) -> PrewarmResult:
    """Sends every chat once to ``target``; returns totals.

    Args:
        target: the server's base URL.
        chats: the chats to send.
        options: headers, concurrency, timeout and model (default: ``PrewarmOptions()``).
        progress: show a progress bar (when ``on_sent`` is not given).
        on_sent: called once per chat answered or failed, instead of an own progress bar.
    """
    opts = options or PrewarmOptions()
    result = PrewarmResult()
    url = target.rstrip("/") + "/v1/chat/completions"
    bar = None
    tick: Callable[[], object]
    if on_sent is None:
        bar = tqdm(total=len(chats), desc="prewarm", unit="prompt", disable=not progress)
        tick = bar.update
    else:
        tick = on_sent
    with (
        httpx.Client(timeout=opts.timeout_s, headers=opts.headers) as client,
        ThreadPoolExecutor(max_workers=max(opts.concurrency, 1)) as pool,
    ):
        for usage in pool.map(lambda messages: _send(client, url, opts.body(messages)), chats):
            tick()
            result.add(usage)
    if bar is not None:
        bar.close()
    return result


def _send(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The answer's ``usage`` (``{}`` if it has none), or None when the request failed."""
    try:
        resp = client.post(url, json=body)
    except httpx.HTTPError as exc:
        log.warning("prewarm request to %s failed: %s", url, exc)
        return None
    if resp.status_code != 200:
        log.warning("prewarm request to %s got %d: %s", url, resp.status_code, resp.text[:200])
        return None
    usage: dict[str, Any] = resp.json().get("usage") or {}
    return usage


def prewarm_targets(
    targets: list[str],
    chats: list[list[dict[str, Any]]],
    options: PrewarmOptions | None = None,
    *,
    progress: bool = True,
) -> dict[str, PrewarmResult]:
    """Sends every chat to every target, all targets at once; returns totals per target.

    ``options.concurrency`` requests are in flight per target, as with one target.
    """
    bar = tqdm(total=len(chats) * len(targets), desc="prewarm", unit="prompt", disable=not progress)
    lock = threading.Lock()  # one bar, advanced from every target's thread

    def sent() -> None:
        with lock:
            bar.update(1)

    try:
        with ThreadPoolExecutor(max_workers=max(len(targets), 1)) as pool:
            futures = {t: pool.submit(prewarm, t, chats, options, on_sent=sent) for t in targets}
            return {t: f.result() for t, f in futures.items()}
    finally:
        bar.close()


#: The API key sent when ``--api-key`` is not given (the operator's prewarm Job sets it).
API_KEY_ENV = "DSCACHE_PREWARM_API_KEY"
#: The gateway token that lets ``--tenant`` through (the server's gateway secret).
GATEWAY_TOKEN_ENV = "DSCACHE_PREWARM_GATEWAY_TOKEN"  # noqa: S105 - a variable's name


def _options(args: argparse.Namespace) -> PrewarmOptions:
    headers: dict[str, str] = {}
    if args.tenant:
        # The server trusts a tenant header only with the gateway token.
        headers["X-Dscache-Tenant"] = args.tenant
        headers["X-Dscache-Gateway-Token"] = os.environ.get(GATEWAY_TOKEN_ENV, "")
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return PrewarmOptions(
        headers=headers, concurrency=args.concurrency, timeout_s=args.timeout, model=args.model
    )


def run_cli(args: argparse.Namespace) -> int:
    """Entry point of ``dscache prewarm``."""
    try:
        targets = parse_targets(args.target)
    except ValueError as exc:
        log.error("bad --target: %s", exc)
        return 2
    try:
        chats = read_prompts(Path(args.prompts))
    except (OSError, ValueError) as exc:
        log.error("cannot read prompts: %s", exc)
        return 2
    if args.tenant and not os.environ.get(GATEWAY_TOKEN_ENV):
        log.error("--tenant needs the server's gateway secret in $%s", GATEWAY_TOKEN_ENV)
        return 2
    if args.top_n is not None:
        if args.top_n < 1:
            log.error("--top-n must be at least 1, got %d", args.top_n)
            return 2
        chats = chats[: args.top_n]
    results = prewarm_targets(targets, chats, _options(args), progress=not args.quiet)
    dead = []
    for target, r in results.items():
        print(
            f"prewarm {target}: {r.sent} sent, {r.failed} failed, "
            f"{r.prompt_tokens} prompt tokens, {r.cached_tokens} already cached"
        )
        if chats and not r.sent:
            dead.append(target)
    if dead:
        print(f"prewarm: no prompt reached {', '.join(dead)}")
        return 1
    return 0
