"""The router configurations whose rendered nginx.conf is kept byte for byte.

Issue 31 moves the router's rendering (nginx.conf from a template file, the Lua as
real ``.lua`` files) into a package of its own; where behaviour does not change,
the rendered text must not either, so no router pod reloads on upgrade.
``data/nginx_conf_golden.json`` holds the text each config below rendered before
that move (``python tests/router/golden_confs.py`` rewrites it: only for a change
made on purpose, named in the commit).

The cases cover every branch of the renderer: NGINX's own consistent hash and the
Lua balancer, each prompt-key mode, session memory with and without a previous
track, the picker, metrics and config watching on and off, debug headers,
per-client limits, modules to load, IPv6 upstreams, and the operator's own shape
(slot-named tracks, the mounted config watched).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "nginx_conf_golden.json"

_STABLE = ("10.0.0.1:8000", "10.0.0.2:8000")
_CANARY = ("10.0.1.1:8000",)

#: name -> RouterConfig fields (JSON-shaped, as RouterConfig(**fields) takes them).
CASES: dict[str, dict[str, Any]] = {
    "defaults-empty": {},
    "hash-no-lua": {
        "stable": _STABLE, "canary": _CANARY, "canary_weight": 10, "balance_factor": 0,
        "prompt_key": {"mode": "off"}, "metrics": False,
    },
    "hash-prompt-key": {
        "stable": _STABLE, "canary": _CANARY, "canary_weight": 33.333, "balance_factor": 0,
        "prompt_key": {"mode": "lua", "max_bytes": 1024, "max_messages": 3},
    },
    "balanced-default": {"stable": _STABLE, "canary": _CANARY, "canary_weight": 10},
    "balanced-ipv6-factor-2": {
        "stable": ("10.0.0.1:8000", "[fd00::2]:8000"), "balance_factor": 2,
        "upstream_keepalive": 0,
    },
    "canary-only": {"canary": _CANARY, "canary_weight": 5},
    "session-memory-previous": {
        "stable": _STABLE, "canary": _CANARY, "previous": ("10.0.2.1:8000",),
        "canary_weight": 50, "session_memory_s": 3600, "session_memory_mib": 32,
        "stable_name": "green", "canary_name": "blue", "previous_name": "retired",
    },
    "picker-debug-limits": {
        "stable": _STABLE, "picker": "127.0.0.1:8090", "picker_timeout_ms": 100,
        "debug_headers": True, "max_connections_per_client": 8, "max_connections": 64,
        "worker_processes": 2, "worker_connections": 2048, "access_log": "/tmp/access.log",
        "error_log": "/tmp/error.log", "cookie_max_age_s": 0,
        "session_header": "X-Conversation", "cookie_name": "conv", "upstream_header": "X-Conv",
    },
    "operator-shape": {
        "listen": "8080", "stable": _STABLE, "canary": _CANARY, "canary_weight": 25,
        "stable_name": "blue", "canary_name": "green", "previous_name": "retired",
        "session_memory_s": 1800, "picker": "127.0.0.1:8090", "picker_timeout_ms": 250,
        "load_modules": [
            "/usr/lib/nginx/modules/ndk_http_module.so",
            "/usr/lib/nginx/modules/ngx_http_lua_module.so",
        ],
        "pid_file": "/tmp/router/nginx.pid", "temp_dir": "/tmp/router", "watch_config": True,
        "config_path": "/etc/dscache-router/nginx.conf", "watch_interval_s": 2.5,
        "max_body_bytes": 1048576, "client_body_timeout_s": 10,
        "client_header_timeout_s": 5, "send_timeout_s": 30, "proxy_read_timeout_s": 120,
    },
    "metrics-off-balanced": {"stable": _STABLE, "metrics": False, "prompt_key": {"mode": "off"}},
}  # fmt: skip


def render(name: str) -> str:
    """Case ``name``'s nginx.conf as the renderer of this checkout writes it."""
    from dscache_router.nginx import RouterConfig, render_nginx_conf

    return render_nginx_conf(RouterConfig(**CASES[name]))


def main() -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    DATA.write_text(
        json.dumps({"commit": commit, "confs": {name: render(name) for name in CASES}}, indent=1)
        + "\n"
    )
    print(f"wrote {len(CASES)} configs rendered at {commit} to {DATA}", file=sys.stderr)


if __name__ == "__main__":
    main()
