"""Renders the router's ``nginx.conf`` from a :class:`RouterConfig` (a pure function).

The text's shape is the Jinja2 template ``templates/nginx.conf.j2``; this module
derives the few values it reads (the track variable, the split, the status JSON)
and the Lua it embeds (:mod:`.lua`), and adds the config watcher, whose id is a
hash of the rest. See :mod:`dscache_router.nginx` for the routing rules the text
implements. Invariants: the output depends only on the config (no clock, no randomness);
upstream lists are rendered in the order given (the consistent-hash ring does
not depend on it).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jinja2

from dscache import metricnames as names
from dscache.routing import INFLIGHT_HEADER
from dscache_router.nginx.config import (
    API_PREFIX,
    ROUTE_KEY_HEADER,
    STRIPPED_HEADERS,
    RouterConfig,
)
from dscache_router.nginx.lua import fill

#: The second line of a watched config: ``# dscache-config-id: <hex>``.
CONFIG_ID_PREFIX = "# dscache-config-id: "
#: Where the router serves its Prometheus metrics (with ``metrics`` on).
METRICS_PATH = names.ROUTER_METRICS_PATH
PICKER_METRICS_PATH = names.PICKER_METRICS_PATH
#: The internal location through which the balancer's Lua asks the picker.
PICKER_PATH = "/_dscache/pick"
#: The internal location through which the Lua asks the picker where a session lives.
LOCATE_PATH = "/_dscache/locate"
#: The internal location through which the Lua asks the picker which pod holds a
#: conversation (by what the pods hold, for a request no session places).
HOLDER_PATH = "/_dscache/holder"
#: Seconds a pod's in-flight report counts in the load bound.
REPORT_TTL_S = 5
#: The picker's health, proxied by NGINX (the picker listens on the pod's loopback).
PICKER_HEALTH_PATH = "/dscache/router/picker-health"
#: Seconds a pod that failed a try is passed over (NGINX's ``fail_timeout``).
FAIL_TIMEOUT_S = 10


#: ``templates/nginx.conf.j2``: block tags on lines of their own leave no trace, a
#: name the context lacks is an error, and nothing is escaped (values are validated).
_TEMPLATE = jinja2.Environment(
    loader=jinja2.PackageLoader(__package__ or "dscache_router.nginx", "templates"),
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    undefined=jinja2.StrictUndefined,
    autoescape=False,  # noqa: S701 - nginx.conf, not HTML; every value is validated
).get_template("nginx.conf.j2")


def render_nginx_conf(config: RouterConfig) -> str:
    """The complete ``nginx.conf`` (main context) for ``config``.

    Args:
        config: the router's settings and both tracks' upstream addresses.

    Returns:
        The configuration text; identical configs give identical text. With
        ``watch_config``, its second line is ``# dscache-config-id: <hex>``.
    """
    text = _TEMPLATE.render(_context(config))
    if not config.watch_config:
        return text
    lines = text.split("\n")
    interval = f"{config.watch_interval_s:g}"
    seed = "\n".join([*lines, f"watch {config.config_path} {interval}"])
    config_id = hashlib.sha256(seed.encode()).hexdigest()[:16]
    values = {"PATH": f'"{config.config_path}"', "ID": f'"{config_id}"', "INTERVAL": interval}
    watch = f"    init_worker_by_lua_block {{\n{fill('watch.lua', values, indent=8)}\n    }}"
    at = lines.index("http {") + 1
    out = [lines[0], CONFIG_ID_PREFIX + config_id, *lines[1:at], watch, *lines[at:]]
    return "\n".join(out)


def _context(c: RouterConfig) -> dict[str, Any]:
    """What ``templates/nginx.conf.j2`` reads besides the config itself."""
    weight = c.effective_weight
    memory = c.session_memory_s > 0
    counted = c.metrics or c.balanced
    tracks = ((c.stable_name, c.stable), (c.canary_name, c.canary), (c.previous_name, c.previous))
    status = {
        "canary_weight": weight,
        "stable": c.stable_name if c.stable else None,
        "canary": c.canary_name if c.canary else None,
        "previous": c.previous_name if c.previous else None,
        "session_memory_s": c.session_memory_s,
    }
    track_var = "$dscache_chosen_track" if memory else "$dscache_new_track"
    return {
        "c": c,
        "tmp": c.temp_dir.rstrip("/") or "/",
        "header_var": "$http_" + c.session_header.lower().replace("-", "_"),
        "cookie_var": "$cookie_" + c.cookie_name,
        "memory": memory,
        "counted": counted,
        "track_var": track_var,
        # A weight of 0 or 100 is a constant track; else split_clients' share (at most
        # two decimals, no trailing zeros).
        "split_percent": None
        if weight <= 0.0 or weight >= 100.0
        else f"{weight:.2f}".rstrip("0").rstrip("."),
        "new_track": c.canary_name if weight >= 100.0 else c.stable_name,
        "router_lua": _router_lua(c) if counted else "",
        "tracks": [(name, pods) for name, pods in tracks if pods],
        "status": json.dumps(status, sort_keys=True),
        "access_lua": _access_lua(c, memory, track_var),
        "fail_timeout_s": FAIL_TIMEOUT_S,
        "metrics_path": METRICS_PATH,
        "picker_path": PICKER_PATH,
        "locate_path": LOCATE_PATH,
        "holder_path": HOLDER_PATH,
        "picker_health_path": PICKER_HEALTH_PATH,
        "picker_metrics_path": PICKER_METRICS_PATH,
        "api_prefix": API_PREFIX,
        "route_key_header": ROUTE_KEY_HEADER,
        "inflight_header": INFLIGHT_HEADER,
        "stripped_headers": STRIPPED_HEADERS,
        "not_forwarded": _NOT_FORWARDED,
        "busy": _BUSY,
    }


def _lua_strings(items: tuple[str, ...]) -> str:
    # Every item is validated (addresses, track names, metric names): no quote, no backslash.
    return "{" + ", ".join(f'"{i}"' for i in items) + "}"


def _router_lua(c: RouterConfig) -> str:
    """The body of ``init_by_lua_block``: the ``dscache_router`` module for ``c``."""
    tracks = ((c.stable_name, c.stable), (c.canary_name, c.canary), (c.previous_name, c.previous))
    upstreams = ", ".join(
        f'["dscache_{name}"] = {_lua_strings(pods)}' for name, pods in tracks if pods and c.balanced
    )
    metric = {
        "requests": names.ROUTER_REQUESTS + "_total",
        "retries": names.ROUTER_RETRIES + "_total",
        "tries": names.ROUTER_UPSTREAM_REQUESTS + "_total",
        "errors": names.ROUTER_UPSTREAM_ERRORS + "_total",
        "skips": names.ROUTER_OVERLOAD_SKIPS + "_total",
        "inflight": names.ROUTER_UPSTREAM_INFLIGHT,
        "weight": names.ROUTER_CANARY_WEIGHT,
        "factor": names.ROUTER_BALANCE_FACTOR,
        "picks": names.ROUTER_PICKS + "_total",
        "locates": names.ROUTER_LOCATES + "_total",
        "holders": names.ROUTER_HOLDERS + "_total",
    }
    table = (
        f"{{factor = {float(c.balance_factor)!r}, balanced = {str(c.balanced).lower()}, "
        f"fail_timeout = {FAIL_TIMEOUT_S}, pin_ttl = {c.pin_ttl_s}, "
        f"canary_weight = {float(c.effective_weight)!r}, "
        f"pods = {_lua_strings(c.all_pods)}, "
        f'picker = {str(c.picker is not None).lower()}, picker_path = "{PICKER_PATH}", '
        f'locate_path = "{LOCATE_PATH}", holder_path = "{HOLDER_PATH}", '
        f"lead_messages = {c.prompt_key.max_messages}, report_ttl = {REPORT_TTL_S}, "
        # The picker's lookup must end before NGINX stops waiting for it.
        f"locate_budget_ms = {max(1, c.picker_timeout_ms * 3 // 5)}, "
        f"tracks = {_lua_strings(('stable', 'canary', 'previous'))}, "
        f"upstreams = {{{upstreams}}}, "
        "names = {" + ", ".join(f'{k} = "{v}"' for k, v in metric.items()) + "}}"
    )
    return fill("router.lua", {"CONFIG": table}, indent=8)


#: The router's own answers, in OpenAI's error format (no quote or backslash inside).
_NOT_FORWARDED = (
    '{"error":{"message":"not found: the router forwards /v1/ only",'
    '"type":"invalid_request_error","code":"not_found"}}\\n'
)
_BUSY = (
    '{"error":{"message":"the router is at its connection limit; retry",'
    '"type":"server_error","code":"overloaded"}}\\n'
)


def _access_lua(c: RouterConfig, memory: bool, track_var: str) -> list[str]:
    """The ``access_by_lua_block`` body: prompt key, session memory, picker (in order)."""
    access: list[str] = []
    if c.prompt_key.mode == "lua":
        key = c.prompt_key
        values = {
            "SCAN": str(key.max_bytes * 4),
            "MAX_BYTES": str(key.max_bytes),
            "MAX_MESSAGES": str(key.max_messages),
        }
        access.append(fill("prompt_key.lua", values, indent=12))
    if memory:
        live = "{" + ", ".join(f'["{t}"] = true' for t in c.live_tracks) + "}"
        values = {"LIVE": live, "TTL": str(c.session_memory_s)}
        sections = {"picker": c.picker is not None}
        access.append(fill("session_memory.lua", values, indent=12, sections=sections))
    if c.picker is not None:
        access.append(
            f'            require("dscache_router").pick("dscache_" .. ngx.var.{track_var[1:]})'
        )
    return access
