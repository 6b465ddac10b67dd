"""The chaos matrix: each fault, what a user sees, and what recovers it.

Contract:
    * ``CASES`` is the order ``dscache chaos`` runs them in; ``baseline`` (no
      fault) comes first, and every other case's TTFT is compared with it.
    * ``name`` is the case's key in the JSON (``cases[].name``), stable across
      releases; ``fault``, ``user_sees`` and ``recovers`` are the README's words.
    * ``inject`` and ``undo`` are :class:`FaultDriver` methods: ``inject`` acts at
      once, ``undo`` returns once the stack is whole again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dscache_tools.chaos.faults import FaultDriver


@dataclass(frozen=True)
class Case:
    """One row of the matrix."""

    name: str
    fault: str
    user_sees: str
    recovers: str
    inject: Callable[[FaultDriver], str]
    undo: Callable[[FaultDriver], str]


CASES: tuple[Case, ...] = (
    Case(
        name="baseline",
        fault="none",
        user_sees="the reference latency",
        recovers="-",
        inject=FaultDriver.nothing,
        undo=FaultDriver.nothing,
    ),
    Case(
        name="sidecar_killed",
        fault="kill -9 one pod's sidecar",
        user_sees="no error; that pod recomputes prompts it had cached",
        recovers="the server's circuit breaker skips the cache, then reconnects to the "
        "restarted sidecar, which reopens its blocks from disk",
        inject=FaultDriver.kill_sidecar,
        undo=FaultDriver.restart_sidecar,
    ),
    Case(
        name="server_killed",
        fault="kill -9 one model server",
        user_sees="no error; its requests are answered by the other pod, slower",
        recovers="NGINX retries requests that got no answer on the other pod "
        "(proxy_next_upstream); the restarted server finds its sidecar's blocks",
        inject=FaultDriver.kill_server,
        undo=FaultDriver.restart_server,
    ),
    Case(
        name="router_reloaded",
        fault="NGINX reload (SIGHUP)",
        user_sees="nothing",
        recovers="old workers finish the requests they hold; new ones take the rest",
        inject=FaultDriver.reload_router,
        undo=FaultDriver.nothing,
    ),
    Case(
        name="cache_disk_full",
        fault="one sidecar's cache disk full",
        user_sees="no error; new blocks of that pod are not stored",
        recovers="writes fail as RESOURCE_EXHAUSTED, the server drops them and serves; "
        "reads go on; stores resume once there is room",
        inject=FaultDriver.fill_disk,
        undo=FaultDriver.free_disk,
    ),
    Case(
        name="sidecar_slow",
        fault="one sidecar answers each call 1 s late",
        user_sees="no error; that pod's cache calls time out and it recomputes",
        recovers="the server's per-call deadline (0.5 s) and circuit breaker; "
        "the cache is used again once the sidecar is fast",
        inject=FaultDriver.slow_sidecar,
        undo=FaultDriver.fast_sidecar,
    ),
)
