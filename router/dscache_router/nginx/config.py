"""What the router's nginx.conf depends on: :class:`RouterConfig`, validated.

Every string that reaches the file is checked here against a strict pattern,
so a config value can never inject NGINX directives. With bounded loads on
(``balance_factor`` > 0) every upstream address must be an IP literal: the Lua
balancer hands NGINX an address and resolves no names.
"""

from __future__ import annotations

import ipaddress
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

#: The only path prefix the router forwards to the model pods: the OpenAI API.
#: Everything else a model pod serves (/metrics, /dscache/*, /health) stays off the
#: client-facing port; the router answers 404 itself.
API_PREFIX = "/v1/"
#: Headers a client may never set for the model server: the router sends them empty.
#: The tenant is named by whoever authenticated the client, never by the client.
STRIPPED_HEADERS: tuple[str, ...] = ("X-Dscache-Tenant", "X-Dscache-Gateway-Token")
#: Header carrying the routing key upstream, whatever its source (for logs only).
ROUTE_KEY_HEADER = "X-Dscache-Route-Key"
_RESERVED_HEADERS = frozenset(
    h.lower() for h in (*STRIPPED_HEADERS, ROUTE_KEY_HEADER, "X-Dscache-Track", "Host")
)


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
        default=16,
        ge=1,
        le=4096,
        description="shared memory for remembered sessions (their tracks, and their pods "
        "with bounded loads on), MiB each",
    )
    session_header: HeaderName = Field(default="X-Session-ID", description="client's key header")
    cookie_name: CookieName = Field(default="dscache_session", description="session cookie")
    cookie_max_age_s: int = Field(default=86400, ge=0, description="cookie lifetime, seconds")
    upstream_header: HeaderName = Field(
        default="X-Session-ID",
        description="header carrying a real session id (the client's header or cookie) to the "
        "model server; a prompt-derived or fresh key is never sent as a session",
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
        default=8 << 20,
        ge=1024,
        le=256 << 20,
        description="largest request body; kept in memory (so at most max_connections of "
        "them at once)",
    )
    max_connections: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="client requests in progress at once (past it: 503 with Retry-After); "
        "bounds the memory of buffered bodies to max_connections x max_body_bytes",
    )
    max_connections_per_client: int = Field(
        default=0,
        ge=0,
        le=100_000,
        description="requests in progress at once per client address; 0 = no per-address "
        "limit (behind a gateway every client has the gateway's address)",
    )
    client_body_timeout_s: int = Field(
        default=30, ge=1, le=3600, description="seconds between two reads of a request body"
    )
    client_header_timeout_s: int = Field(
        default=15, ge=1, le=3600, description="seconds to receive a request's headers"
    )
    send_timeout_s: int = Field(
        default=60, ge=1, le=3600, description="seconds between two writes to a client"
    )
    upstream_keepalive: int = Field(default=32, ge=0, description="idle upstream connections")
    proxy_read_timeout_s: int = Field(default=600, ge=1, description="upstream read timeout")
    debug_headers: bool = Field(
        default=False, description="add X-Dscache-Track/-Upstream/-Key-Source response headers"
    )
    balance_factor: float = Field(
        default=1.25,
        ge=0.0,
        le=100.0,
        description="bounded-load consistent hashing: a pod takes a request only while its "
        "in-flight count is below ceil(balance_factor * (in-flight of the track + 1) / live pods), "
        "else the next pod on the ring does; 0: plain consistent hash (no Lua); else >= 1",
    )
    picker: Address | None = Field(
        default=None,
        description="HOST:PORT of a picker (`dscache picker`) the balancer consults per request "
        "for the pod holding its longest cached prefix (KV-aware routing; needs balance_factor "
        "> 0); None: the session / prompt-key hash alone",
    )
    picker_timeout_ms: int = Field(
        default=250,
        ge=10,
        le=10_000,
        description="how long a request waits for the picker before the hash places it",
    )
    metrics: bool = Field(
        default=True,
        description="count requests, retries and upstream errors in Lua and serve them at "
        "/dscache/router/metrics (needs the Lua module)",
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

    @model_validator(mode="after")
    def _balancer_inputs(self) -> RouterConfig:
        if 0.0 < self.balance_factor < 1.0:
            raise ValueError(
                f"balance_factor must be 0 (off) or at least 1, not {self.balance_factor}"
            )
        if self.balance_factor > 0.0:
            names = [a for a in self.stable + self.canary + self.previous if not _is_ip(a)]
            if names:
                raise ValueError(
                    f"upstream addresses {names} are not IP:PORT; the bounded-load balancer "
                    "(balance_factor > 0) resolves no names: give IPs or set balance_factor=0"
                )
        if self.picker is not None and not self.balanced:
            raise ValueError("picker needs the Lua balancer: set balance_factor >= 1")
        if self.upstream_header.lower() in _RESERVED_HEADERS:
            raise ValueError(f"upstream_header {self.upstream_header!r} is reserved by the router")
        return self

    @property
    def balanced(self) -> bool:
        """Whether the Lua balancer (bounded loads) picks the pods."""
        return self.balance_factor > 0.0

    @property
    def pin_ttl_s(self) -> int:
        """Seconds the balancer keeps a session on its pod after its last request:
        the session memory's, else 30 minutes."""
        return self.session_memory_s or 1800

    @property
    def uses_lua(self) -> bool:
        """Whether the rendered config needs NGINX's Lua module."""
        return (
            self.prompt_key.mode == "lua"
            or self.session_memory_s > 0
            or self.watch_config
            or self.metrics
            or self.balanced
        )

    @property
    def all_pods(self) -> tuple[str, ...]:
        """Every upstream address, stable then canary then previous."""
        return self.stable + self.canary + self.previous

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


def _is_ip(address: str) -> bool:
    host = address.rsplit(":", 1)[0].removeprefix("[").removesuffix("]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
