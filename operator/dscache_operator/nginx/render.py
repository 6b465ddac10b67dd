"""Renders the router's ``nginx.conf`` from a :class:`RouterConfig` (a pure function).

See :mod:`dscache_operator.nginx` for the routing rules the text implements.
Invariants: the output depends only on the config (no clock, no randomness);
upstream lists are rendered in the order given (the consistent-hash ring does
not depend on it).
"""

from __future__ import annotations

import hashlib
import json

from dscache import metricnames as names
from dscache.routing import INFLIGHT_HEADER
from dscache_operator.nginx.config import (
    API_PREFIX,
    ROUTE_KEY_HEADER,
    STRIPPED_HEADERS,
    RouterConfig,
)
from dscache_operator.nginx.lua import (
    LUA_PROMPT_KEY,
    LUA_SESSION_LOCATE,
    LUA_SESSION_MEMORY,
    LUA_WATCH,
)
from dscache_operator.nginx.lua_router import LUA_ROUTER

#: The second line of a watched config: ``# dscache-config-id: <hex>``.
CONFIG_ID_PREFIX = "# dscache-config-id: "
#: Where the router serves its Prometheus metrics (with ``metrics`` on).
METRICS_PATH = names.ROUTER_METRICS_PATH
#: The internal location through which the balancer's Lua asks the picker.
PICKER_PATH = "/_dscache/pick"
#: The internal location through which the Lua asks the picker where a session lives.
LOCATE_PATH = "/_dscache/locate"
#: Seconds a pod's in-flight report counts in the load bound.
REPORT_TTL_S = 5
#: The picker's health, proxied by NGINX (the picker listens on the pod's loopback).
PICKER_HEALTH_PATH = "/dscache/router/picker-health"
#: Seconds a pod that failed a try is passed over (NGINX's ``fail_timeout``).
FAIL_TIMEOUT_S = 10


def _nginx_var(header: str) -> str:
    return "$http_" + header.lower().replace("-", "_")


def _upstream(name: str, servers: tuple[str, ...], keepalive: int, balanced: bool) -> list[str]:
    lines = [f"    upstream {name} {{"]
    if balanced:
        lines += [
            "        server 0.0.0.1;  # never used: the Lua balancer names each try's pod",
            "        balancer_by_lua_block {",
            f'            require("dscache_router").balance("{name}")',
            "        }",
        ]
    else:
        lines.append("        hash $dscache_key consistent;")
        lines += [
            f"        server {a} max_fails=1 fail_timeout={FAIL_TIMEOUT_S}s;" for a in servers
        ]
    if keepalive:
        lines.append(f"        keepalive {keepalive};")
    lines.append("    }")
    return lines


def _track_selector(c: RouterConfig) -> list[str]:
    """``$dscache_new_track``: the track a new session takes at the current weight."""
    weight = c.effective_weight
    if weight <= 0.0 or weight >= 100.0:
        track = c.canary_name if weight >= 100.0 else c.stable_name
        return ["    map $dscache_key $dscache_new_track {", f"        default {track};", "    }"]
    pct = f"{weight:.2f}".rstrip("0").rstrip(".")
    return [
        '    split_clients "${dscache_key}" $dscache_new_track {',
        f"        {pct}% {c.canary_name};",
        f"        * {c.stable_name};",
        "    }",
    ]


def _lua_strings(items: tuple[str, ...]) -> str:
    # Every item is validated (addresses, track names, metric names): no quote, no backslash.
    return "{" + ", ".join(f'"{i}"' for i in items) + "}"


def _router_lua(c: RouterConfig) -> str:
    """``init_by_lua_block`` defining the ``dscache_router`` module for ``c``."""
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
    }
    table = (
        f"{{factor = {float(c.balance_factor)!r}, balanced = {str(c.balanced).lower()}, "
        f"fail_timeout = {FAIL_TIMEOUT_S}, pin_ttl = {c.pin_ttl_s}, "
        f"canary_weight = {float(c.effective_weight)!r}, "
        f"pods = {_lua_strings(c.all_pods)}, "
        f'picker = {str(c.picker is not None).lower()}, picker_path = "{PICKER_PATH}", '
        f'locate_path = "{LOCATE_PATH}", report_ttl = {REPORT_TTL_S}, '
        # The picker's lookup must end before NGINX stops waiting for it.
        f"locate_budget_ms = {max(1, c.picker_timeout_ms * 3 // 5)}, "
        f"tracks = {_lua_strings(('stable', 'canary', 'previous'))}, "
        f"upstreams = {{{upstreams}}}, "
        "names = {" + ", ".join(f'{k} = "{v}"' for k, v in metric.items()) + "}}"
    )
    return LUA_ROUTER.replace("@CONFIG@", table)


def _role_map(c: RouterConfig, track_var: str) -> list[str]:
    """``$dscache_track``: stable, canary or previous, for headers and logs."""
    return [
        f"    map {track_var} $dscache_track {{",
        f"        {c.canary_name} canary;",
        f"        {c.previous_name} previous;",
        "        default stable;",
        "    }",
    ]


def render_nginx_conf(config: RouterConfig) -> str:
    """The complete ``nginx.conf`` (main context) for ``config``.

    Args:
        config: the router's settings and both tracks' upstream addresses.

    Returns:
        The configuration text; identical configs give identical text. With
        ``watch_config``, its second line is ``# dscache-config-id: <hex>``.
    """
    lines = _render_lines(config)
    if not config.watch_config:
        return "\n".join(lines)
    interval = f"{config.watch_interval_s:g}"
    seed = "\n".join([*lines, f"watch {config.config_path} {interval}"])
    config_id = hashlib.sha256(seed.encode()).hexdigest()[:16]
    watch = (
        LUA_WATCH.replace("@PATH@", config.config_path)
        .replace("@ID@", config_id)
        .replace("@INTERVAL@", interval)
    )
    at = lines.index("http {") + 1
    out = [lines[0], CONFIG_ID_PREFIX + config_id, *lines[1:at], watch, *lines[at:]]
    return "\n".join(out)


def _render_lines(config: RouterConfig) -> list[str]:
    c = config
    weight = c.effective_weight
    cookie_var = "$cookie_" + c.cookie_name
    header_var = _nginx_var(c.session_header)
    tmp = c.temp_dir.rstrip("/") or "/"
    lines = ["# Rendered by dscache_operator.nginx from a RouterConfig; edits are overwritten."]
    lines += [f"load_module {m};" for m in c.load_modules]
    lines += [
        f"worker_processes {c.worker_processes};",
        f"pid {c.pid_file};",
        f"error_log {c.error_log} warn;",
        "",
        "events {",
        f"    worker_connections {c.worker_connections};",
        "}",
        "",
        "http {",
        f"    access_log {c.access_log};"
        if c.access_log == "off"
        else f"    access_log {c.access_log} combined;",
        f"    client_body_temp_path {tmp}/nginx-client-body;",
        f"    proxy_temp_path {tmp}/nginx-proxy;",
        f"    fastcgi_temp_path {tmp}/nginx-fastcgi;",
        f"    uwsgi_temp_path {tmp}/nginx-uwsgi;",
        f"    scgi_temp_path {tmp}/nginx-scgi;",
        # Bodies stay in memory so the prompt key can read them without a file; how
        # many at once is bounded by limit_conn below, how slowly by the timeouts.
        f"    client_max_body_size {c.max_body_bytes};",
        f"    client_body_buffer_size {c.max_body_bytes};",
        f"    client_body_timeout {c.client_body_timeout_s}s;",
        f"    client_header_timeout {c.client_header_timeout_s}s;",
        f"    send_timeout {c.send_timeout_s}s;",
        "    reset_timedout_connection on;",
        "    limit_conn_zone $server_port zone=dscache_conns:1m;",
        *(
            ["    limit_conn_zone $binary_remote_addr zone=dscache_peers:10m;"]
            if c.max_connections_per_client
            else []
        ),
        "    limit_conn_status 503;",
        "    server_tokens off;",
        "",
        "    # Session key: header, else cookie, else prompt-derived or new.",
        f"    map {header_var} $dscache_client_key {{",
        f'        "" {cookie_var};',
        f"        default {header_var};",
        "    }",
        f"    map {header_var}:{cookie_var} $dscache_client_source {{",
        '        ":" new;',
        '        "~^:" cookie;',
        "        default header;",
        "    }",
        # Only a client's own id is a session: a prompt-derived or fresh key routes
        # the request but is never sent as the session header, so two users who
        # share an opening never share a session (nor its ordering lock).
        "    map $dscache_key_source $dscache_session_id {",
        "        header $dscache_key;",
        "        cookie $dscache_key;",
        '        default "";',
        "    }",
        # A fresh key becomes the client's session through a cookie; a prompt key never does.
        "    map $dscache_key_source $dscache_set_cookie {",
        '        header "";',
        '        cookie "";',
        '        prompt "";',
        f'        default "{c.cookie_name}=$dscache_key; Path=/; Max-Age={c.cookie_max_age_s}; '
        'HttpOnly; SameSite=Lax";',
        "    }",
        "",
    ]
    memory = c.session_memory_s > 0
    track_var = "$dscache_chosen_track" if memory else "$dscache_new_track"
    lines += _track_selector(c)
    lines += _role_map(c, track_var)
    if memory:
        lines.append(f"    lua_shared_dict dscache_sessions {c.session_memory_mib}m;")
    counted = c.metrics or c.balanced
    if counted:
        lines.append("    lua_shared_dict dscache_router 1m;")
        if c.balanced:
            lines.append(f"    lua_shared_dict dscache_pins {c.session_memory_mib}m;")
        lines.append(_router_lua(c))
    for name, pods in (
        (c.stable_name, c.stable),
        (c.canary_name, c.canary),
        (c.previous_name, c.previous),
    ):
        if pods:
            lines += _upstream(f"dscache_{name}", pods, c.upstream_keepalive, c.balanced)
    if c.picker is not None:
        lines += [
            "    upstream dscache_picker {",
            f"        server {c.picker};",
            "        keepalive 16;",
            "    }",
        ]
    status = json.dumps(
        {
            "canary_weight": weight,
            "stable": c.stable_name if c.stable else None,
            "canary": c.canary_name if c.canary else None,
            "previous": c.previous_name if c.previous else None,
            "session_memory_s": c.session_memory_s,
        },
        sort_keys=True,
    )
    lines += [
        "",
        "    server {",
        f"        listen {c.listen};",
        "        set $dscache_key $dscache_client_key;",
        "        set $dscache_key_source $dscache_client_source;",
        '        if ($dscache_key = "") {',
        "            set $dscache_key $request_id;",
        "        }",
        *(['        set $dscache_chosen_track "";'] if memory else []),
        "",
        "        location = /dscache/router/health {",
        "            access_log off;",
        '            return 200 "ok\\n";',
        "        }",
        "",
        "        location = /dscache/router/status {",
        "            access_log off;",
        "            default_type application/json;",
        f"            return 200 '{status}\\n';",
        "        }",
        "",
        *_metrics_location(c),
        *_picker_location(c),
        # Only the API is forwarded: a model pod's /metrics, /dscache/* (filters, key
        # info, templates) and probes are not the clients' business.
        "        location / {",
        "            access_log off;",
        "            default_type application/json;",
        f"            return 404 '{_NOT_FORWARDED}';",
        "        }",
        "",
        f"        location {API_PREFIX} {{",
        f"            limit_conn dscache_conns {c.max_connections};",
        *(
            [f"            limit_conn dscache_peers {c.max_connections_per_client};"]
            if c.max_connections_per_client
            else []
        ),
    ]
    access = _access_lua(c, memory, track_var)
    if access:
        lines += ["        access_by_lua_block {", *access, "        }"]
    if c.balanced:
        lines += [
            "            header_filter_by_lua_block {",
            '                require("dscache_router").report()',
            "            }",
        ]
    if counted:
        lines += [
            "            log_by_lua_block {",
            '                require("dscache_router").log()',
        ]
        lines += ["            }"]
    lines += [
        "            add_header Set-Cookie $dscache_set_cookie always;",
    ]
    if c.debug_headers:
        lines += [
            "            add_header X-Dscache-Track $dscache_track always;",
            "            add_header X-Dscache-Upstream $upstream_addr always;",
            "            add_header X-Dscache-Key-Source $dscache_key_source always;",
        ]
    if not c.stable and not c.canary:
        lines += [
            "            add_header Retry-After 5 always;",
            '            return 503 "no model server is ready\\n";',
        ]
    else:
        lines += [
            # limit_conn's 503 (an upstream's own 503 passes through untouched).
            "            error_page 503 = @dscache_busy;",
            f"            proxy_pass http://dscache_{track_var};",
            f"            proxy_set_header {c.upstream_header} $dscache_session_id;",
            f"            proxy_set_header {ROUTE_KEY_HEADER} $dscache_key;",
            f"            proxy_hide_header {INFLIGHT_HEADER};",
            # A client never names its tenant (an empty value drops the header).
            *(f'            proxy_set_header {h} "";' for h in STRIPPED_HEADERS),
            "            proxy_set_header Host $host;",
            "            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
            "            proxy_set_header X-Dscache-Track $dscache_track;",
            "            proxy_http_version 1.1;",
            '            proxy_set_header Connection "";',
            # Streaming responses (SSE) must reach the client token by token.
            "            proxy_buffering off;",
            f"            proxy_read_timeout {c.proxy_read_timeout_s}s;",
            # A pod that refuses the connection: the next one on the ring.
            "            proxy_next_upstream error timeout http_502 http_503 non_idempotent;",
            "            proxy_next_upstream_tries 2;",
        ]
    lines += [
        "        }",
        "",
        # limit_conn's 503: a JSON error with Retry-After.
        "        location @dscache_busy {",
        "            add_header Retry-After 1 always;",
        "            default_type application/json;",
        f"            return 503 '{_BUSY}';",
        "        }",
        "    }",
        "}",
        "",
    ]
    return lines


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
        access.append(
            LUA_PROMPT_KEY
            % {
                "scan": c.prompt_key.max_bytes * 4,
                "max_bytes": c.prompt_key.max_bytes,
                "max_messages": c.prompt_key.max_messages,
            }
        )
    if memory:
        live = ", ".join(f'["{t}"] = true' for t in c.live_tracks)
        locate = LUA_SESSION_LOCATE if c.picker is not None else ""
        access.append(
            LUA_SESSION_MEMORY % {"live": live, "ttl": c.session_memory_s, "locate": locate}
        )
    if c.picker is not None:
        access.append(
            f'            require("dscache_router").pick("dscache_" .. ngx.var.{track_var[1:]})'
        )
    return access


def _picker_location(c: RouterConfig) -> list[str]:
    """The internal location the balancer asks the picker through (no client reaches it)."""
    if c.picker is None:
        return []
    timeout = f"{c.picker_timeout_ms}ms"
    return [
        f"        location = {PICKER_PATH} {{",
        "            internal;",
        "            access_log off;",
        "            proxy_pass http://dscache_picker/pick;",
        "            proxy_http_version 1.1;",
        '            proxy_set_header Connection "";',
        *(f'            proxy_set_header {h} "";' for h in STRIPPED_HEADERS),
        f"            proxy_connect_timeout {timeout};",
        f"            proxy_send_timeout {timeout};",
        f"            proxy_read_timeout {timeout};",
        "        }",
        "",
        f"        location = {LOCATE_PATH} {{",
        "            internal;",
        "            access_log off;",
        "            proxy_pass http://dscache_picker/locate;",
        "            proxy_http_version 1.1;",
        '            proxy_set_header Connection "";',
        # Only the query: neither the client's body nor its headers (credentials).
        "            proxy_pass_request_body off;",
        "            proxy_pass_request_headers off;",
        f"            proxy_connect_timeout {timeout};",
        f"            proxy_send_timeout {timeout};",
        f"            proxy_read_timeout {timeout};",
        "        }",
        "",
        f"        location = {PICKER_HEALTH_PATH} {{",
        "            access_log off;",
        "            proxy_pass http://dscache_picker/health;",
        "            proxy_http_version 1.1;",
        '            proxy_set_header Connection "";',
        "            proxy_connect_timeout 1s;",
        "            proxy_read_timeout 5s;",
        "        }",
        "",
    ]


def _metrics_location(c: RouterConfig) -> list[str]:
    if not c.metrics:
        return []
    return [
        f"        location = {METRICS_PATH} {{",
        "            access_log off;",
        "            content_by_lua_block {",
        '                require("dscache_router").metrics()',
        "            }",
        "        }",
        "",
    ]
