"""``dscache prewarm``: send prompts to servers so their prefixes get stored.

Prompts come from a JSONL file (each line one chat: ``{"messages": [...]}`` or a
bare list of messages) and/or from the templates the serving pods mined from
live traffic (``--mined-from``: each pod's ``GET /dscache/templates``, read
with the gateway token; each template is sent as its own tenant's token ids to
``/v1/completions``). Every prompt is sent as a one-token completion (the
prefill stores the prompt's full blocks in the background).

Several targets (``--target`` repeated and/or comma-separated) are the pods of
one track. Where each prompt goes is the placement:

* ``all`` (the default): every prompt to every target, as a pod may receive a
  session with any of them.
* ``ring``: the router's own choice. The prompt's key is computed from the
  exact bytes sent, as the router computes it for a request without a session
  id (:func:`dscache_router.ring.prompt_key`; the bytes are compact UTF-8 JSON, as
  the OpenAI Python SDK sends), and the prompt goes to the first
  ``--copies`` pods of its walk on the track's ring (:class:`dscache_router.ring.Ring`),
  skipping the first ``--skip-copies`` (warmed by an earlier step): the pods the
  router tries for that prompt, in order. A canary rollout warms one copy
  before its first step and more as its share of sessions grows.

Per target, ``--concurrency`` requests are in flight, all targets at once. A
request that could not connect (nothing reached the server) is tried again with
backoff for ``--connect-wait`` seconds (30): a new pod's address can refuse
connections for its first seconds, until the cluster's NetworkPolicy controller
has admitted the Job's pod, and a pod just marked ready may still be binding.
Failures are counted and reported per target; the command exits non-zero when
any target had prompts to take and took none (a pod that cannot be warmed is
worth a failed Job), and with 2 when the prompts cannot be read. Mined
templates are best effort: a pod that cannot answer is logged and skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from dscache_router.ring import Ring, prompt_key
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential
from tqdm import tqdm

from dscache_server.auth import GATEWAY_TOKEN_HEADER

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
#: The server's default tenant header (``ServerSettings.tenant_header``).
TENANT_HEADER = "X-Dscache-Tenant"

Placement = Literal["all", "ring"]


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


def encode(body: dict[str, Any]) -> bytes:
    """A request body as the OpenAI Python SDK (httpx) sends it: compact JSON, UTF-8.

    The router keys an id-less request by these bytes, so a prompt warmed with them
    lands where that client's requests with the same messages land.
    """
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


@dataclass(frozen=True)
class Prompt:
    """One request to send: the endpoint's path, the body's exact bytes, its own headers."""

    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    def key(self, max_bytes: int, max_messages: int) -> str:
        """The router's key of this request (it carries no session id)."""
        return prompt_key(self.body, max_bytes=max_bytes, max_messages=max_messages)


@dataclass(frozen=True)
class PrewarmOptions:
    """How prompts are sent.

    Attributes:
        headers: extra request headers (tenant, API key).
        concurrency: requests in flight per target.
        timeout_s: seconds per request.
        model: model name to send (default: the server's).
        connect_wait_s: how long a request that could not connect is tried again.
    """

    headers: dict[str, str] = field(default_factory=dict)
    concurrency: int = 1
    timeout_s: float = 300.0
    model: str | None = None
    connect_wait_s: float = 30.0

    def body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The request body of one chat: a one-token greedy completion."""
        body: dict[str, Any] = {"messages": messages, "max_tokens": 1, "temperature": 0}
        if self.model:
            body["model"] = self.model
        return body

    def chat(self, messages: list[dict[str, Any]]) -> Prompt:
        """One chat as a request (serialized once: the bytes keyed are the bytes sent)."""
        return Prompt(CHAT_PATH, encode(self.body(messages)))

    def tokens(self, ids: Sequence[int], tenant: str | None, gateway_token: str) -> Prompt:
        """Token ids as a one-token completion, sent as ``tenant`` (None: the anonymous one)."""
        body: dict[str, Any] = {"prompt": list(ids), "max_tokens": 1, "temperature": 0}
        if self.model:
            body["model"] = self.model
        # The anonymous tenant is whoever sends no credentials: nothing to prove.
        headers = (
            ()
            if tenant is None
            else ((TENANT_HEADER, tenant), (GATEWAY_TOKEN_HEADER, gateway_token))
        )
        return Prompt(COMPLETIONS_PATH, encode(body), headers)


@dataclass(frozen=True)
class PlacementOptions:
    """Which targets each prompt goes to (see the module docstring).

    Attributes:
        placement: ``all`` or ``ring``.
        copies: ring: the pods of each prompt's walk to warm.
        skip_copies: ring: the first pods of the walk, warmed before.
        max_bytes: the router's ``promptKey.maxBytes``.
        max_messages: the router's ``promptKey.maxMessages``.
    """

    placement: Placement = "all"
    copies: int = 1
    skip_copies: int = 0
    max_bytes: int = 4096
    max_messages: int = 2


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


def address(url: str) -> str:
    """``host:port`` of a target URL, as the router's upstreams name the pod."""
    rest = url.split("://", 1)[1].split("/", 1)[0]
    if rest.rpartition(":")[2].isdigit() and not rest.endswith("]"):
        return rest
    return rest + (":443" if url.startswith("https://") else ":80")


def place(
    prompts: Sequence[Prompt], targets: Sequence[str], options: PlacementOptions
) -> dict[str, list[Prompt]]:
    """The prompts each target gets, in the prompts' order.

    Raises:
        ValueError: ring placement with copies below 1 or skip_copies below 0.
    """
    if options.placement == "all":
        return {t: list(prompts) for t in targets}
    out: dict[str, list[Prompt]] = {t: [] for t in targets}
    if options.copies < 1 or options.skip_copies < 0:
        raise ValueError("ring placement needs copies >= 1 and skip_copies >= 0")
    by_address = {address(t): t for t in targets}
    ring = Ring(by_address)
    for p in prompts:
        walk = ring.walk(p.key(options.max_bytes, options.max_messages))
        for pod in walk[options.skip_copies : options.copies]:
            out[by_address[pod]].append(p)
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
    return send(target, [opts.chat(m) for m in chats], opts, progress=progress, on_sent=on_sent)


def send(
    target: str,
    prompts: Sequence[Prompt],
    options: PrewarmOptions,
    *,
    progress: bool = True,
    on_sent: Callable[[], None] | None = None,
) -> PrewarmResult:
    """Sends each prompt once to ``target`` (``options.concurrency`` at a time); totals."""
    result = PrewarmResult()
    bar = None
    tick: Callable[[], object]
    if on_sent is None:
        bar = tqdm(total=len(prompts), desc="prewarm", unit="prompt", disable=not progress)
        tick = bar.update
    else:
        tick = on_sent
    base = target.rstrip("/")
    headers = {"Content-Type": "application/json", **options.headers}
    with (
        httpx.Client(timeout=options.timeout_s, headers=headers) as client,
        ThreadPoolExecutor(max_workers=max(options.concurrency, 1)) as pool,
    ):
        for usage in pool.map(lambda p: _send(client, base, p, options.connect_wait_s), prompts):
            tick()
            result.add(usage)
    if bar is not None:
        bar.close()
    return result


def _send(
    client: httpx.Client, base: str, prompt: Prompt, connect_wait_s: float = 0.0
) -> dict[str, Any] | None:
    """The answer's ``usage`` (``{}`` if it has none), or None when the request failed.

    Connection failures (nothing sent) are tried again for ``connect_wait_s``."""
    url = base + prompt.path
    post = Retrying(
        retry=retry_if_exception_type((httpx.ConnectError, httpx.ConnectTimeout)),
        wait=wait_exponential(multiplier=0.25, max=4.0),
        stop=stop_after_delay(connect_wait_s),
        reraise=True,
    )
    try:
        resp = post(client.post, url, content=prompt.body, headers=dict(prompt.headers))
    except httpx.HTTPError as exc:
        log.warning("prewarm request to %s failed: %s", url, exc)
        return None
    if resp.status_code != 200:
        log.warning("prewarm request to %s got %d: %s", url, resp.status_code, resp.text[:200])
        return None
    usage: dict[str, Any] = resp.json().get("usage") or {}
    return usage


def send_placed(
    placed: dict[str, list[Prompt]], options: PrewarmOptions, *, progress: bool = True
) -> dict[str, PrewarmResult]:
    """Sends each target its prompts, all targets at once; returns totals per target.

    ``options.concurrency`` requests are in flight per target, as with one target.
    """
    total = sum(len(p) for p in placed.values())
    bar = tqdm(total=total, desc="prewarm", unit="prompt", disable=not progress)
    lock = threading.Lock()  # one bar, advanced from every target's thread

    def sent() -> None:
        with lock:
            bar.update(1)

    try:
        with ThreadPoolExecutor(max_workers=max(len(placed), 1)) as pool:
            futures = {t: pool.submit(send, t, p, options, on_sent=sent) for t, p in placed.items()}
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
        headers[TENANT_HEADER] = args.tenant
        headers[GATEWAY_TOKEN_HEADER] = os.environ.get(GATEWAY_TOKEN_ENV, "")
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return PrewarmOptions(
        headers=headers,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        model=args.model,
        connect_wait_s=args.connect_wait,
    )


def _mined(args: argparse.Namespace, options: PrewarmOptions) -> list[Prompt]:
    """The live templates of ``--mined-from`` as prompts (none when every pod failed)."""
    from dscache_server.templatelog import fetch_templates

    token = os.environ.get(GATEWAY_TOKEN_ENV, "")
    try:
        urls = parse_targets(args.mined_from)
        mined = fetch_templates(urls, token, args.mined_top, timeout_s=min(args.timeout, 30.0))
    except ValueError as exc:
        log.warning("no mined templates: %s", exc)
        print(f"prewarm: no mined templates ({exc})")
        return []
    print(f"prewarm: {len(mined)} mined templates from {len(urls)} servers")
    return [options.tokens(t.tokens, t.tenant_header, token) for t in mined]


def _read_file(args: argparse.Namespace, options: PrewarmOptions) -> list[Prompt] | None:
    if args.prompts is None:
        return []
    try:
        chats = read_prompts(Path(args.prompts))
    except (OSError, ValueError) as exc:
        log.error("cannot read prompts: %s", exc)
        return None
    if args.top_n is not None:
        chats = chats[: args.top_n]
    return [options.chat(m) for m in chats]


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, or None."""
    if args.prompts is None and not args.mined_from:
        return "give --prompts and/or --mined-from"
    if (args.tenant or args.mined_from) and not os.environ.get(GATEWAY_TOKEN_ENV):
        return f"--tenant and --mined-from need the server's gateway secret in ${GATEWAY_TOKEN_ENV}"
    if args.top_n is not None and args.top_n < 1:
        return f"--top-n must be at least 1, got {args.top_n}"
    if args.copies < 1 or args.skip_copies < 0:
        return "--copies must be at least 1 and --skip-copies at least 0"
    return None


def run_cli(args: argparse.Namespace) -> int:
    """Entry point of ``dscache prewarm``."""
    try:
        targets = parse_targets(args.target)
    except ValueError as exc:
        log.error("bad --target: %s", exc)
        return 2
    problem = _check(args)
    if problem:
        log.error("%s", problem)
        return 2
    options = _options(args)
    prompts = _read_file(args, options)
    if prompts is None:
        return 2
    if args.mined_from:
        prompts += _mined(args, options)
    placement = PlacementOptions(
        placement=args.placement,
        copies=args.copies,
        skip_copies=args.skip_copies,
        max_bytes=args.prompt_key_max_bytes,
        max_messages=args.prompt_key_max_messages,
    )
    placed = place(prompts, targets, placement)
    results = send_placed(placed, options, progress=not args.quiet)
    dead = []
    for target, r in results.items():
        print(
            f"prewarm {target}: {r.sent} sent, {r.failed} failed, "
            f"{r.prompt_tokens} prompt tokens, {r.cached_tokens} already cached"
        )
        if placed[target] and not r.sent:
            dead.append(target)
    if dead:
        print(f"prewarm: no prompt reached {', '.join(dead)}")
        return 1
    return 0
