"""``dscache bench shared-tier``: does a session's cache follow it to another pod?

Two runs on the finance workload, each on a fresh local stack of real model servers
and sidecars (:class:`~dscache_tools.demo.stack.LocalStack`); one run's sidecars
share a Redis Cluster (3 masters on loopback, started here), the other's do not.
Every figure is compared within this one invocation.

* ``moved``: every session's early turns go to pod A; its last turn goes to pod
  B, whose disk has never seen that session (a drained node, a rescheduled pod).
  Token hit ratio and TTFT of those moved turns, with and without the shared
  tier; in the shared run the same turn is then sent again to pod B (now a local
  hit) and to a server without a cache (recompute), for the TTFT comparison.
* ``scale_out``: sessions are hashed over 2 pods for their first turns, then over
  4 (two fresh pods join): hit ratio of the turns after the scale-out.
* ``faults`` (shared run only): the cluster frozen (SIGSTOP), then killed, while
  more sessions move; every request must still succeed, within recompute plus
  the configured remote timeout.

JSON: ``with_shared`` / ``without_shared`` (``token_hit_ratio``, ``ttft_p50_s`` of
the moved turns, ``requests``), ``moved_turn_ttft`` (P50 of remote hit, local hit,
recompute and their ratios), ``scale_out``, ``faults`` and ``failed_requests`` over
the whole run (faults included).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from dscache_tools.bench import Doc, ratio, report
from dscache_tools.demo.stack import LocalStack, Server, StackOptions
from dscache_tools.procs import terminate_on_sigterm
from dscache_tools.rediscluster import LocalRedisCluster, RedisClusterStartError
from dscache_tools.workload import ChatRequest, WorkloadConfig, generate

log = logging.getLogger(__name__)

#: The sidecars' per-operation remote timeout in this bench (the default).
REMOTE_TIMEOUT_S = 0.25


@dataclass
class Outcome:
    """One request's answer as the client saw it."""

    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    error: str = ""


@dataclass
class Tally:
    """Requests of one kind: hit ratio, latency, failures."""

    outcomes: list[Outcome] = field(default_factory=list)

    def add(self, o: Outcome) -> Outcome:
        self.outcomes.append(o)
        return o

    @property
    def failed(self) -> int:
        return sum(1 for o in self.outcomes if not o.ok)

    def hit_ratio(self) -> float | None:
        prompt = sum(o.prompt_tokens for o in self.outcomes if o.ok)
        return sum(o.cached_tokens for o in self.outcomes if o.ok) / prompt if prompt else None

    def p50(self) -> float | None:
        secs = [o.seconds for o in self.outcomes if o.ok]
        return statistics.median(secs) if secs else None

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self.outcomes),
            "failed": self.failed,
            "token_hit_ratio": self.hit_ratio(),
            "ttft_p50_s": self.p50(),
        }


class Client:
    """Sends one chat request to one server; answers are short (time ~ TTFT)."""

    def __init__(self) -> None:
        self._http = httpx.Client(timeout=300.0)
        self.all = Tally()

    def send(self, server: Server, req: ChatRequest) -> Outcome:
        body = {"messages": req.messages, "max_tokens": 1, "temperature": 0.0}
        t0 = time.perf_counter()
        try:
            resp = self._http.post(server.url + "/v1/chat/completions", json=body)
            seconds = time.perf_counter() - t0
            resp.raise_for_status()
            usage = resp.json()["usage"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            return self.all.add(Outcome(False, error=f"{type(exc).__name__}: {exc}"))
        details = usage.get("prompt_tokens_details") or {}
        return self.all.add(
            Outcome(
                True,
                int(usage["prompt_tokens"]),
                int(details.get("cached_tokens") or 0),
                seconds,
            )
        )

    def close(self) -> None:
        self._http.close()


def sessions(quick: bool, seed: int, count: int) -> list[list[ChatRequest]]:
    """Finance sessions of at least 3 turns, each a list of its turns in order."""
    reqs = generate(
        WorkloadConfig(
            sessions=count,
            seed=seed,
            companies=2 if quick else 4,
            min_turns=3,
            max_turns=3 if quick else 4,
            drop_id_share=0.0,
            reconnect_share=0.0,
            max_tokens=1,
        )
    )
    by: dict[str, list[ChatRequest]] = defaultdict(list)
    for r in reqs:
        by[r.session].append(r)
    return [sorted(turns, key=lambda r: r.turn) for turns in by.values()]


def settle(stack: LocalStack, quiet_s: float = 1.5, timeout_s: float = 60.0) -> None:
    """Waits until the servers' background stores (and the sidecars' writes to the
    shared tier) are done: no sidecar's stored-blocks counter moves for ``quiet_s``."""
    urls = [s.metrics_url for s in stack.sidecars]

    def totals() -> tuple[float, ...]:
        out = []
        for url in urls:
            text = httpx.get(url, timeout=5.0).text
            stored = queued = 0.0
            for line in text.splitlines():
                if line.startswith("dscache_sidecar_stored_blocks_total "):
                    stored = float(line.split()[1])
                elif line.startswith("dscache_sidecar_remote_queue_blocks "):
                    queued = float(line.split()[1])
            out += [stored, queued]
        return tuple(out)

    last = totals()
    since = time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = totals()
        queued = now[1::2]
        if now != last or any(queued):
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
    log.warning("the stores did not settle within %.0fs", timeout_s)


def _pick(session: str, pods: int) -> int:
    """The pod of a session among ``pods`` (a stable hash, as the router's)."""
    return int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big") % pods


def run_moved(
    stack: LocalStack, client: Client, convs: Sequence[list[ChatRequest]], recompute: Server | None
) -> dict[str, Tally]:
    """Early turns on pod A, the last turn on pod B (fresh): the moved turns' tallies."""
    a, b = stack.servers[0], stack.servers[1]
    for turns in convs:
        for req in turns[:-1]:
            client.send(a, req)
    settle(stack)
    out = {"moved": Tally(), "local": Tally(), "recompute": Tally()}
    for turns in convs:
        last = turns[-1]
        out["moved"].add(client.send(b, last))
        if recompute is not None:
            out["local"].add(client.send(b, last))  # promoted by now: a local hit
            out["recompute"].add(client.send(recompute, last))
    return out


def run_scale_out(
    stack: LocalStack, client: Client, convs: Sequence[list[ChatRequest]], pods: list[Server]
) -> Tally:
    """First turns hashed over 2 pods, the rest over 4: the later turns' tally."""
    for turns in convs:
        for req in turns[:-1]:
            client.send(pods[_pick(req.session, 2)], req)
    settle(stack)
    after = Tally()
    for turns in convs:
        after.add(client.send(pods[_pick(turns[-1].session, 4)], turns[-1]))
    return after


def run_faults(
    stack: LocalStack,
    client: Client,
    cluster: LocalRedisCluster,
    convs: Sequence[list[ChatRequest]],
    recompute: Server,
) -> dict[str, Any]:
    """Sessions move while the cluster is frozen, then killed; every turn must answer."""
    a, b = stack.servers[0], stack.servers[1]
    for turns in convs:
        for req in turns[:-1]:
            client.send(a, req)
    settle(stack)
    half = max(1, len(convs) // 2)
    out: dict[str, Any] = {}
    for name, group, fault in (
        ("frozen", convs[:half], cluster.pause),
        ("killed", convs[half:], cluster.kill),
    ):
        fault()
        tally, base = Tally(), Tally()
        for turns in group:
            tally.add(client.send(b, turns[-1]))
            base.add(client.send(recompute, turns[-1]))
        worst = max((o.seconds for o in tally.outcomes if o.ok), default=None)
        base_worst = max((o.seconds for o in base.outcomes if o.ok), default=None)
        out[name] = {
            **tally.summary(),
            "ttft_max_s": worst,
            "recompute_ttft_max_s": base_worst,
            "bound_s": None if base_worst is None else base_worst + REMOTE_TIMEOUT_S,
        }
    cluster.resume()
    return out


def run_bench(args: argparse.Namespace) -> Doc:
    """Both runs; returns the JSON document."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    n = 4 if args.quick else 10
    convs = sessions(args.quick, args.seed, 3 * n)
    moved, scaled, faulted = convs[:n], convs[n : 2 * n], convs[2 * n :]
    # A short path: the sidecars' unix sockets live under it (108 bytes at most).
    tmp = None if args.work_dir else tempfile.TemporaryDirectory(prefix="dscache-st-")
    work = Path(args.work_dir) if args.work_dir else Path(tmp.name)  # type: ignore[union-attr]
    client = Client()
    doc: Doc = {"benchmark": "shared-tier", "model": args.model, "sessions": len(convs)}
    opts = StackOptions(
        model=args.model, sidecar_capacity="512MiB", sidecar_segment_size="64MiB", threads=1
    )
    try:
        with LocalRedisCluster(work / "redis") as cluster:
            doc["redis_masters"] = len(cluster.ports)
            for arm in ("without_shared", "with_shared"):
                shared = arm == "with_shared"
                extra = ("--shared-nodes", cluster.nodes) if shared else ()
                log.info("%s: starting 4 pods%s", arm, " and a cache-less server" if shared else "")
                with LocalStack(work / arm, _with_sidecar_args(opts, extra)) as st:
                    pods = st.start_servers(4, cache=True)
                    plain = None
                    if shared:
                        plain = st.start_servers(1, cache=False, prefix="nocache")[0]
                    st.servers[:] = pods  # run_moved uses servers[0] and [1]
                    t = run_moved(st, client, moved, plain)
                    doc[arm] = t["moved"].summary()
                    if shared:
                        loc, rec = t["local"].p50(), t["recompute"].p50()
                        rem = t["moved"].p50()
                        # The repeat on pod B restores every full block of the prompt:
                        # the most any tier could have given the moved turn.
                        doc["moved_ideal_token_hit_ratio"] = t["local"].hit_ratio()
                        doc["moved_turn_ttft"] = {
                            "remote_hit_p50_s": rem,
                            "local_hit_p50_s": loc,
                            "recompute_p50_s": rec,
                            "remote_over_local": ratio(rem, loc),
                            "remote_over_recompute": ratio(rem, rec),
                        }
                    doc.setdefault("scale_out", {})[arm] = run_scale_out(
                        st, client, scaled, pods
                    ).summary()
                    if shared:
                        assert plain is not None
                        doc["faults"] = run_faults(st, client, cluster, faulted, plain)
    finally:
        client.close()
        if tmp is not None:
            tmp.cleanup()
    w, wo = doc["with_shared"], doc["without_shared"]
    doc["ratios"] = {
        "token_hit_ratio": ratio(w["token_hit_ratio"], wo["token_hit_ratio"]),
        "ttft_p50_s": ratio(w["ttft_p50_s"], wo["ttft_p50_s"]),
        "scale_out_token_hit_ratio": ratio(
            doc["scale_out"]["with_shared"]["token_hit_ratio"],
            doc["scale_out"]["without_shared"]["token_hit_ratio"],
        ),
    }
    doc["failed_requests"] = client.all.failed
    return doc


def _with_sidecar_args(opts: StackOptions, extra: tuple[str, ...]) -> StackOptions:
    return replace(opts, sidecar_args=opts.sidecar_args + extra)


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(doc: Doc) -> str:
    """The printed table."""
    lines = [f"{'moved turns':<26} {'requests':>8} {'failed':>6} {'token hit':>9} {'TTFT p50':>9}"]
    for arm in ("without_shared", "with_shared"):
        r = doc[arm]
        lines.append(
            f"{arm:<26} {r['requests']:>8} {r['failed']:>6} "
            f"{_f(r['token_hit_ratio'], '.3f'):>9} {_f(r['ttft_p50_s'], '.3f'):>8}s"
        )
    lines.append(
        f"{'ideal (all full blocks)':<26} {'':>8} {'':>6} "
        f"{_f(doc['moved_ideal_token_hit_ratio'], '.3f'):>9}"
    )
    m = doc["moved_turn_ttft"]
    lines.append(
        f"moved turn TTFT p50: remote hit {_f(m['remote_hit_p50_s'], '.3f')}s, local hit "
        f"{_f(m['local_hit_p50_s'], '.3f')}s ({_f(m['remote_over_local'], '.2f')}x), "
        f"recompute {_f(m['recompute_p50_s'], '.3f')}s "
        f"({_f(m['remote_over_recompute'], '.2f')}x)"
    )
    for arm in ("without_shared", "with_shared"):
        s = doc["scale_out"][arm]
        lines.append(
            f"scale-out 2->4, later turns, {arm}: token hit {_f(s['token_hit_ratio'], '.3f')}"
        )
    for name, f in doc["faults"].items():
        lines.append(
            f"cluster {name}: {f['requests']} requests, {f['failed']} failed, worst TTFT "
            f"{_f(f['ttft_max_s'], '.3f')}s (bound: recompute "
            f"{_f(f['recompute_ttft_max_s'], '.3f')}s + {REMOTE_TIMEOUT_S}s)"
        )
    r = doc["ratios"]
    lines.append(
        f"with / without shared tier: moved-turn token hit {_f(r['token_hit_ratio'], '.2f')}x, "
        f"TTFT p50 {_f(r['ttft_p50_s'], '.2f')}x; scale-out token hit "
        f"{_f(r['scale_out_token_hit_ratio'], '.2f')}x; failed requests {doc['failed_requests']}"
    )
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """``dscache bench shared-tier``: the runs, the table, the JSON (1 if any failed)."""
    with terminate_on_sigterm():
        code = report(
            "shared-tier",
            lambda: run_bench(args),
            table,
            args.json_out,
            (RedisClusterStartError, RuntimeError),
        )
    return code
