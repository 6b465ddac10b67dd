"""Renders the router's ``nginx.conf`` from a :class:`RouterConfig` (a pure function).

Routing rules, in the order NGINX applies them to a request:

1. **Session key.** The ``session_header`` request header (default
   ``X-Session-ID``) if present and non-empty, else the ``cookie_name`` cookie,
   else a key derived from the prompt (when ``prompt_key`` is on and the body
   has one), else a fresh ``$request_id``. Whenever the key did not come from the
   client (prompt-derived or fresh), the response sets it as a cookie, so the
   client's next turn carries it. The key goes upstream as ``upstream_header``
   (default ``X-Session-ID``), which is what the model server reads.
2. **Track.** ``split_clients`` hashes the key (MurmurHash2) onto [0, 100%):
   the first ``canary_weight`` percent of that range goes to the canary track,
   the rest to stable. The canary range only ever grows from 0 as the weight is
   raised, so a session on the canary stays there at every larger weight, and a
   stable session moves at most once (stable -> canary). Weight 0 or 100 is a
   plain constant. A track with no upstreams sends everything to the other
   track; no upstreams at all answers 503.
3. **Pod.** ``hash $dscache_key consistent`` (ketama over CRC32) picks the pod
   within the track, so a conversation keeps hitting the pod that holds its KV
   blocks, and adding or removing one pod moves only about 1/N of the keys.
4. **Prompt key** (``prompt_key``, needs NGINX's Lua module): a request with
   neither header nor cookie is keyed by ``p-`` + MD5 of the leading part of its
   prompt: the first ``max_messages`` entries of ``"messages"`` (the system
   prompt and the first user turn), cut at ``max_bytes`` bytes; for
   ``/v1/completions`` the first ``max_bytes`` of ``"prompt"``. Every turn of a
   conversation, and every conversation opening with the same long document,
   shares that leading part, so id-less turns land on the pod holding it.

5. **Reload on change** (``watch_config``, needs the Lua module; the operator
   turns it on): NGINX runs as the container's only process, with no shell to
   watch its config. Worker 0 runs a timer (``watch_interval_s``) that reads
   the first bytes of ``config_path`` and compares the ``dscache-config-id``
   line there with the id of the config it is running (a literal in its own
   text); on a new id it sends the master SIGHUP through LuaJIT's FFI, once
   per id. The master re-reads the file and keeps serving the old config if
   the new one is invalid (and the worker does not signal again until the id
   changes once more). A ConfigMap volume swaps its ``..data`` symlink
   atomically, so the watcher never reads half a file. The id is a hash of
   everything but the watcher itself, so comparing ids is exact and race-free:
   a change between the master's read and the worker's start is still seen.

Invariants: the output depends only on the config (no clock, no randomness);
every string that reaches the file is validated against a strict pattern, so a
config value can never inject NGINX directives; upstream lists are rendered in
the order given (the consistent-hash ring does not depend on it).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

#: ``load_module`` paths of Debian's ``libnginx-mod-http-ndk`` + ``libnginx-mod-http-lua``.
DEBIAN_LUA_MODULES: tuple[str, ...] = (
    "/usr/lib/nginx/modules/ndk_http_module.so",
    "/usr/lib/nginx/modules/ngx_http_lua_module.so",
)

_ADDRESS_RE = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")
_LISTEN_RE = re.compile(r"^(?:(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):)?[0-9]{1,5}$")
_HEADER_RE = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_COOKIE_RE = re.compile(r"^[A-Za-z0-9_]{1,64}$")
_PATH_RE = re.compile(r"^[A-Za-z0-9_./-]{1,4096}$")
_LOG_RE = re.compile(r"^(?:off|stderr|[A-Za-z0-9_./-]{1,4096})$")


def _matching(pattern: re.Pattern[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{what} {value!r} must match {pattern.pattern}")
        return value

    return AfterValidator(check)


Address = Annotated[str, _matching(_ADDRESS_RE, "upstream address")]
TrackName = Annotated[str, _matching(re.compile(r"^[a-z][a-z0-9-]{0,31}$"), "track name")]
Listen = Annotated[str, _matching(_LISTEN_RE, "listen address")]
HeaderName = Annotated[str, _matching(_HEADER_RE, "header name")]
CookieName = Annotated[str, _matching(_COOKIE_RE, "cookie name")]
FilePath = Annotated[str, _matching(_PATH_RE, "path")]
LogTarget = Annotated[str, _matching(_LOG_RE, "log target")]


class PromptKey(BaseModel):
    """How a request with neither header nor cookie is keyed by its prompt."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["off", "lua"] = Field(
        default="lua", description="'lua' reads the body with NGINX's Lua module; 'off' does not"
    )
    max_bytes: int = Field(
        default=4096, ge=64, le=1 << 20, description="bytes of leading prompt hashed"
    )
    max_messages: int = Field(
        default=2, ge=1, le=64, description="leading chat messages hashed (system + first user)"
    )


class RouterConfig(BaseModel):
    """Everything the router's configuration depends on.

    Upstream addresses are ``host:port`` (IPv6 in brackets). Paths must be
    writable by the NGINX worker; the defaults suit a container with a
    writable ``/tmp`` and a read-only root filesystem.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    listen: Listen = Field(default="8080", description="listen address, PORT or HOST:PORT")
    stable: tuple[Address, ...] = Field(default=(), description="stable track's pods")
    canary: tuple[Address, ...] = Field(default=(), description="canary track's pods")
    previous: tuple[Address, ...] = Field(
        default=(),
        description="pods of a track that takes no new session but keeps serving the sessions "
        "remembered on it (the old stable track during the rollback window); needs "
        "session_memory_s",
    )
    canary_weight: float = Field(
        default=0.0, ge=0.0, le=100.0, description="percent of new sessions on the canary"
    )
    stable_name: TrackName = Field(
        default="stable", description="name of the stable track (the operator's slot: blue, green)"
    )
    canary_name: TrackName = Field(default="canary", description="name of the canary track")
    previous_name: TrackName = Field(default="previous", description="name of the previous track")
    session_memory_s: int = Field(
        default=0,
        ge=0,
        le=7 * 86400,
        description="remember which track each session is on for this many seconds after its "
        "last request, so a live session never changes track (needs the Lua module); "
        "0: a session follows the weight",
    )
    session_memory_mib: int = Field(
        default=16, ge=1, le=4096, description="shared memory for remembered sessions, MiB"
    )
    session_header: HeaderName = Field(default="X-Session-ID", description="client's key header")
    cookie_name: CookieName = Field(default="dscache_session", description="session cookie")
    cookie_max_age_s: int = Field(default=86400, ge=0, description="cookie lifetime, seconds")
    upstream_header: HeaderName = Field(
        default="X-Session-ID", description="header carrying the key to the model server"
    )
    prompt_key: PromptKey = Field(default_factory=PromptKey, description="prompt-derived key")
    load_modules: tuple[FilePath, ...] = Field(
        default=(), description="load_module paths (e.g. DEBIAN_LUA_MODULES; none on OpenResty)"
    )
    worker_processes: int = Field(default=1, ge=1, le=256, description="NGINX workers")
    worker_connections: int = Field(default=1024, ge=16, description="connections per worker")
    # The defaults are for a container's own /tmp (an emptyDir), not a shared one.
    pid_file: FilePath = Field(default="/tmp/nginx.pid", description="NGINX pid file")  # noqa: S108
    temp_dir: FilePath = Field(default="/tmp", description="NGINX's temp files")  # noqa: S108
    error_log: LogTarget = Field(default="stderr", description="error log file or 'stderr'")
    access_log: LogTarget = Field(default="off", description="access log file or 'off'")
    max_body_bytes: int = Field(
        default=16 << 20, ge=1024, description="largest request body; kept in memory"
    )
    upstream_keepalive: int = Field(default=32, ge=0, description="idle upstream connections")
    proxy_read_timeout_s: int = Field(default=600, ge=1, description="upstream read timeout")
    debug_headers: bool = Field(
        default=False, description="add X-Dscache-Track/-Upstream/-Key-Source response headers"
    )
    watch_config: bool = Field(
        default=False,
        description="reload NGINX when the file at config_path changes (needs the Lua module)",
    )
    # The operator's mount point; a local run sets its own file.
    config_path: FilePath = Field(
        default="/etc/dscache-router/nginx.conf",
        description="where NGINX reads this config (what watch_config watches)",
    )
    watch_interval_s: float = Field(
        default=1.0, ge=0.1, le=60.0, description="seconds between two looks at config_path"
    )

    @model_validator(mode="after")
    def _distinct_tracks(self) -> RouterConfig:
        tracks = (self.stable, self.canary, self.previous)
        for i, a in enumerate(tracks):
            for b in tracks[i + 1 :]:
                shared = set(a) & set(b)
                if shared:
                    raise ValueError(f"addresses on two tracks: {sorted(shared)}")
        names = (self.stable_name, self.canary_name, self.previous_name)
        if len(set(names)) != len(names):
            raise ValueError(f"track names must differ: {names}")
        return self

    @property
    def live_tracks(self) -> tuple[str, ...]:
        """Names of the tracks with pods, stable first."""
        named = (
            (self.stable_name, self.stable),
            (self.canary_name, self.canary),
            (self.previous_name, self.previous),
        )
        return tuple(name for name, pods in named if pods)

    @property
    def effective_weight(self) -> float:
        """The canary share actually rendered, after the empty-track rules."""
        if not self.canary:
            return 0.0
        if not self.stable:
            return 100.0
        return round(self.canary_weight, 2)


def _nginx_var(header: str) -> str:
    return "$http_" + header.lower().replace("-", "_")


def _upstream(name: str, servers: tuple[str, ...], keepalive: int) -> list[str]:
    lines = [f"    upstream {name} {{", "        hash $dscache_key consistent;"]
    lines += [f"        server {a} max_fails=1 fail_timeout=10s;" for a in servers]
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


def _role_map(c: RouterConfig, track_var: str) -> list[str]:
    """``$dscache_track``: stable, canary or previous, for headers and logs."""
    return [
        f"    map {track_var} $dscache_track {{",
        f"        {c.canary_name} canary;",
        f"        {c.previous_name} previous;",
        "        default stable;",
        "    }",
    ]


_LUA_SESSION_MEMORY = """            local live = {%(live)s}
            local sessions = ngx.shared.dscache_sessions
            local key = ngx.var.dscache_key
            -- A fresh request id names no session: nothing to remember.
            local remember = ngx.var.dscache_key_source ~= "new"
            local track = remember and sessions:get(key) or nil
            if not track or not live[track] then
                track = ngx.var.dscache_new_track
            end
            ngx.var.dscache_chosen_track = track
            if remember then
                local ok, err = sessions:set(key, track, %(ttl)d)
                if not ok then
                    ngx.log(ngx.WARN, "dscache router: cannot remember a session: ", err)
                end
            end"""


_WATCH_LUA = """\
    init_worker_by_lua_block {
        if ngx.worker.id() ~= 0 then
            return
        end
        local ffi = require "ffi"
        pcall(ffi.cdef, "int kill(int pid, int sig); int getppid(void);")
        local path, loaded, signalled = "@PATH@", "@ID@", nil
        local function file_id()
            local f = io.open(path, "rb")
            if not f then
                return nil
            end
            local head = f:read(512)
            f:close()
            return head and string.match(head, "dscache%-config%-id: (%x+)")
        end
        local function check(premature)
            if premature then
                return
            end
            local id = file_id()
            if id and id ~= loaded and id ~= signalled then
                signalled = id
                ngx.log(ngx.NOTICE, "dscache router: ", path, " is now ", id, ", reloading")
                if ffi.C.kill(ffi.C.getppid(), 1) ~= 0 then
                    ngx.log(ngx.ERR, "dscache router: cannot signal the master, errno ",
                            ffi.errno())
                end
            end
        end
        local ok, err = ngx.timer.every(@INTERVAL@, check)
        if not ok then
            ngx.log(ngx.ERR, "dscache router: cannot watch ", path, ": ", err)
        end
    }"""

CONFIG_ID_PREFIX = "# dscache-config-id: "


_LUA_PROMPT_KEY = """\
            local function prompt_key()
            if ngx.var.dscache_key_source ~= "new" then
                return
            end
            ngx.req.read_body()
            local body = ngx.req.get_body_data()
            if not body then
                local path = ngx.req.get_body_file()
                if path then
                    local f = io.open(path, "rb")
                    if f then
                        body = f:read(%(scan)d)
                        f:close()
                    end
                end
            end
            if not body or body == "" then
                return
            end
            local max_bytes, max_messages = %(max_bytes)d, %(max_messages)d
            local lead
            local s = string.find(body, '"messages"', 1, true)
            local i = s and string.find(body, "[", s, true)
            if i then
                local limit = math.min(#body, i + max_bytes - 1)
                local depth, in_str, esc, count = 0, false, false, 0
                lead = string.sub(body, i, limit)
                for j = i + 1, limit do
                    local c = string.byte(body, j)
                    if in_str then
                        if esc then
                            esc = false
                        elseif c == 92 then
                            esc = true
                        elseif c == 34 then
                            in_str = false
                        end
                    elseif c == 34 then
                        in_str = true
                    elseif c == 123 or c == 91 then
                        depth = depth + 1
                    elseif c == 125 or c == 93 then
                        if depth == 0 then
                            lead = string.sub(body, i, j - 1)
                            break
                        end
                        depth = depth - 1
                        if depth == 0 then
                            count = count + 1
                            if count >= max_messages then
                                lead = string.sub(body, i, j)
                                break
                            end
                        end
                    end
                end
            else
                local p = string.find(body, '"prompt"', 1, true) or 1
                lead = string.sub(body, p, p + max_bytes - 1)
            end
            ngx.var.dscache_key = "p-" .. ngx.md5(lead)
            ngx.var.dscache_key_source = "prompt"
            end
            prompt_key()"""


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
        _WATCH_LUA.replace("@PATH@", config.config_path)
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
        # Bodies stay in memory so the prompt key can read them without a file.
        f"    client_max_body_size {c.max_body_bytes};",
        f"    client_body_buffer_size {c.max_body_bytes};",
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
        "    map $dscache_key_source $dscache_set_cookie {",
        '        header "";',
        '        cookie "";',
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
    for name, pods in (
        (c.stable_name, c.stable),
        (c.canary_name, c.canary),
        (c.previous_name, c.previous),
    ):
        if pods:
            lines += _upstream(f"dscache_{name}", pods, c.upstream_keepalive)
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
        "        location / {",
    ]
    access: list[str] = []
    if c.prompt_key.mode == "lua":
        access.append(
            _LUA_PROMPT_KEY
            % {
                "scan": c.prompt_key.max_bytes * 4,
                "max_bytes": c.prompt_key.max_bytes,
                "max_messages": c.prompt_key.max_messages,
            }
        )
    if memory:
        live = ", ".join(f'["{t}"] = true' for t in c.live_tracks)
        access.append(_LUA_SESSION_MEMORY % {"live": live, "ttl": c.session_memory_s})
    if access:
        lines += ["        access_by_lua_block {", *access, "        }"]
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
            f"            proxy_pass http://dscache_{track_var};",
            f"            proxy_set_header {c.upstream_header} $dscache_key;",
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
    lines += ["        }", "    }", "}", ""]
    return lines
