"""The sidecar's settings: one typed object, read from ``DSCACHE_SIDECAR_*`` env vars.

Sizes (``capacity_bytes``, ``segment_bytes``, ``lmdb_map_bytes``) are
``pydantic.ByteSize``: a plain number of bytes or a number with a unit, binary
(``512MiB``, ``2GiB``) or decimal (``10G``, ``10GB``).

Command-line flags override environment variables, which override defaults. The
prefix is long on purpose: Kubernetes injects ``<SERVICE>_PORT`` variables for
every Service, and a short prefix such as ``KVCACHE_`` would collide.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ByteSize, Field, SecretStr, TypeAdapter, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_BYTE_SIZE = TypeAdapter(ByteSize)


def _byte_size(value: object) -> int:
    # Kubernetes spells binary units without the B ("20Gi"); pydantic wants "20GiB".
    if isinstance(value, str) and value.strip()[-1:] in ("i", "I"):
        value = value.strip() + "B"
    return int(_BYTE_SIZE.validate_python(value))


#: A size in bytes: an int, or a string such as ``4096``, ``512MiB``, ``2GiB``, ``20Gi``,
#: ``10G`` (parsed by ``pydantic.ByteSize``; ``G`` is decimal, ``GiB``/``Gi`` binary).
Bytes = Annotated[int, BeforeValidator(_byte_size)]


class SidecarSettings(BaseSettings):
    """Every knob of the sidecar daemon. Units are in the field names or docs."""

    model_config = SettingsConfigDict(
        env_prefix="DSCACHE_SIDECAR_", extra="forbid", use_attribute_docstrings=True
    )

    data_dir: Path
    """Directory of the segment files and the LMDB index."""
    capacity_bytes: Bytes = 4 * 1024**3
    """Bytes of segment space (all segments together)."""
    segment_bytes: Bytes = 256 * 1024**2
    """Bytes per segment file; capped at capacity; a block never spans two."""
    socket: Path | None = None
    """Unix socket path (mode 0600); default <data_dir>/sidecar.sock."""
    tcp: str | None = None
    """Optional extra listen address, loopback only, e.g. 127.0.0.1:50051."""
    metrics_host: str = "0.0.0.0"
    """Address of the /metrics HTTP server."""
    metrics_port: int | None = 9400
    """Port of the /metrics HTTP server; 0 = any free port; unset = off."""
    policy: str = ""
    """Eviction policy name; empty = the default policy."""
    high_watermark: float = 0.95
    """Eviction starts when used space would pass this share of capacity."""
    low_watermark: float = 0.85
    """Eviction frees space down to this share of capacity."""
    durable: bool = False
    """Fsync block bytes before publishing (survives power loss, not only crashes)."""
    lease_ttl_s: float = 30.0
    """Default lease lifetime, seconds."""
    max_lease_ttl_s: float = 120.0
    """Longest lease a client may ask for, seconds."""
    reservation_ttl_s: float = 30.0
    """How long an Allocate reservation waits for its Commit, seconds."""
    restart_quarantine_s: float | None = None
    """Seconds after a restart during which space that readers of the previous
    process may still map is not reused; default = max_lease_ttl_s."""
    segment_init: Literal["zero", "fallocate", "sparse"] = "zero"
    """How new segment files are preallocated: zero-filled (block writes are then
    overwrites, about 10x faster on ext4), posix_fallocate (instant start), or not at
    all: ``sparse`` files take disk only as blocks are written (tests, laptops; a
    full disk then refuses writes instead of being ruled out at start)."""
    verify_commits: bool = False
    """Re-read and hash each committed block even when the writer sent its
    checksum (readers verify every block anyway)."""
    verify_on_start: Literal["header", "full"] = "header"
    """Reconcile checks every block's header (fast) or also its payload checksum."""
    lmdb_map_bytes: Bytes = 1024**3
    """LMDB map size (index capacity), bytes."""
    stats_flush_s: float = 5.0
    """How often access statistics are written to the index, seconds."""
    reader_check_s: float = Field(default=30.0, gt=0)
    """How often the index's reader slots of processes that died (a model server
    killed while it read the index) are freed, seconds; also done at start."""
    max_keys_per_request: int = 65536
    """Longest chain a request may carry, blocks."""
    grpc_workers: int = 8
    """gRPC server worker threads."""
    readyz_timeout_s: float = Field(default=2.0, gt=0)
    """Seconds the /readyz health RPC over the socket may take."""
    drain_max_s: float = Field(default=20.0, ge=0)
    """After SIGTERM, the longest the daemon serves on while clients are still
    connected to its unix socket (a model server finishing its in-flight requests and
    queued stores), seconds; it stops as soon as the last one disconnects. 0 = stop
    at once. Keep it below the pod's terminationGracePeriodSeconds (30 by default).
    SIGINT, or a second SIGTERM, stops at once."""
    stream_chunk_bytes: int = 1024**2
    """Chunk size of streaming Get, bytes."""
    tenant_quota: float = Field(default=1.0, gt=0, le=1)
    """The largest share of capacity one tenant may hold, in (0, 1]; 1 = no quota.
    A write over it evicts that tenant's own least recently used blocks first."""
    holdings_refresh_s: float = Field(default=2.0, ge=0)
    """Seconds between rebuilds of the holdings filter (a Bloom filter of every block
    key in the index) served at ``GET /dscache/holdings`` on the HTTP port, for a
    router that picks the pod holding the longest prefix; a rebuild is skipped while
    the index is unchanged. 0 = not published (the path is 404)."""
    internal_token: SecretStr = SecretStr("")
    """The token the router's picker sends (``X-Dscache-Internal-Token``) to read
    ``/dscache/holdings``; empty: the filter is served to whoever reaches the HTTP
    port (warned at start). /metrics and the probes never ask for it."""
    kv_events_endpoint: str = ""
    """Publish what the store holds as vLLM KV events (ZeroMQ PUB, msgpack) bound to
    this address, e.g. ``tcp://*:5557``, for routers that learn holdings from them
    (llm-d, Dynamo, the picker; :mod:`dscache_sidecar.kvevents`); empty = off."""
    kv_events_replay_endpoint: str = ""
    """Where subscribers ask for missed batches (ZeroMQ ROUTER, vLLM's replay
    protocol), e.g. ``tcp://*:5558``; empty = no replay."""
    kv_events_topic: str = ""
    """The topic frame of every KV event message."""
    kv_events_medium: str = "STORAGE"
    """The medium the events name (vLLM's name for a storage tier)."""
    kv_events_buffer_batches: int = Field(default=10_000, ge=1)
    """Batches kept for replay; an older request gets the whole holdings again."""
    kv_events_batch_s: float = Field(default=0.05, gt=0, le=10)
    """How long store changes gather into one batch, seconds."""
    kv_events_open: bool = False
    """Serve KV events without authentication even with an internal token (for
    routers that cannot speak ZeroMQ PLAIN; keep others out with a NetworkPolicy).
    With a token and this off, subscribers log in with PLAIN as ``dscache``."""
    fault_injection: bool = False
    """Serve ``/debug/fault`` on the HTTP port to slow calls down or fail writes as a
    full disk does (:mod:`dscache_sidecar.faults`). A testing aid: never in production."""

    shared_nodes: str = ""
    """The shared tier: comma-separated ``host:port`` startup nodes of a Redis Cluster
    (:mod:`dscache_sidecar.shared`); empty = no shared tier, the store is node-local."""
    shared_username: str = ""
    """ACL user name for the shared tier (empty = the default user)."""
    shared_password: SecretStr = SecretStr("")
    """Password for the shared tier (empty = no AUTH)."""
    shared_key_prefix: str = Field(default="dscache", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    """First part of every remote name (``<prefix>:v1|v2:<tenant>:<key>``): a namespace's
    own prefix, which its Redis ACL user's key pattern (``~<prefix>:*``) confines it to."""
    shared_signing_key: SecretStr = SecretStr("")
    """The namespace's HMAC-SHA256 key: values written are signed with it, and a value
    read must carry a signature made with it (or ``shared_signing_key_previous``), else it
    is a miss, dropped and counted (``remote_blocks_total{result="forged"}``). Empty:
    values are unsigned (anyone who can write to the cluster could forge one) and a
    warning says so at start."""
    shared_signing_key_previous: SecretStr = SecretStr("")
    """A key being rotated out: its signatures are still accepted, never made."""
    shared_tls: bool | None = None
    """Speak TLS to the shared tier; unset: TLS when ``shared_tls_ca_file`` names a CA
    (a cluster that offers TLS), else plain TCP."""
    shared_tls_ca_file: Path | None = None
    """CA bundle that signs the shared tier's certificates (default: the system's)."""
    shared_tls_verify_hostname: bool = True
    """Check the shared tier's certificate names against the node addresses."""
    shared_timeout_s: float = Field(default=0.25, gt=0, le=30)
    """Seconds one remote operation (a pipelined lookup, one fetch batch, one write
    batch) may take; past it the operation is a miss (or a dropped write)."""
    shared_fetch_budget_s: float = Field(default=1.0, gt=0, le=60)
    """Seconds one Lease may spend fetching a prefix from the shared tier in all; what
    arrived by then is used, the rest is recomputed."""
    shared_write_policy: Literal["reused", "all"] = "reused"
    """Which blocks are written to the shared tier: ``reused`` = blocks hit at least
    once here, and blocks that continue a chain that was (a conversation that came
    back); ``all`` = every stored block (write-through)."""
    shared_ttl_s: int = Field(default=86400, ge=1)
    """Seconds a block lives in the shared tier after it was written or last read."""
    shared_queue_blocks: int = Field(default=1024, ge=1)
    """Blocks waiting to be written to the shared tier at most; more are dropped and
    counted (never blocking a request)."""
    shared_retry_s: float = Field(default=5.0, gt=0)
    """After a failed remote operation the tier is skipped this many seconds (every
    request is then local-only at no extra latency), then tried again."""
    shared_fetch_batch: int = Field(default=8, ge=1, le=1024)
    """Blocks per pipelined fetch; the next batch is fetched while one is stored."""

    @model_validator(mode="after")
    def _check(self) -> SidecarSettings:
        if self.capacity_bytes < 64 * 1024:
            raise ValueError("capacity must be at least 64KiB")
        segment = min(self.segment_bytes, self.capacity_bytes)
        self.segment_bytes = segment - segment % 4096
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        if self.shared_nodes:
            for node in self.shared_node_list:
                host, _, port = node.rpartition(":")
                if not host or not port.isdigit() or not 0 < int(port) < 65536:
                    raise ValueError(f"shared_nodes: {node!r} is not host:port")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name} must be a tcp:// or ipc:// address, not {value!r}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.tcp is not None:
            host = self.tcp.rsplit(":", 1)[0].strip("[]")
            if host not in ("127.0.0.1", "localhost", "::1"):
                raise ValueError("the TCP listener is loopback only (127.0.0.1, localhost or ::1)")
        return self

    @property
    def socket_path(self) -> Path:
        return self.socket if self.socket is not None else self.data_dir / "sidecar.sock"

    @property
    def shared_node_list(self) -> list[str]:
        """The shared tier's startup nodes (``host:port``), empty without one."""
        return [n.strip() for n in self.shared_nodes.split(",") if n.strip()]

    @property
    def shared_tls_on(self) -> bool:
        """Whether the shared tier is spoken to over TLS (``shared_tls``, else a CA given)."""
        if self.shared_tls is not None:
            return self.shared_tls
        return self.shared_tls_ca_file is not None

    @property
    def quarantine_s(self) -> float:
        if self.restart_quarantine_s is None:
            return self.max_lease_ttl_s
        return self.restart_quarantine_s


def add_sidecar_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``dscache sidecar``; each overrides its ``DSCACHE_SIDECAR_*`` variable."""
    p.add_argument("--data-dir", help="segment files + LMDB index directory")
    p.add_argument("--capacity", help="segment space, e.g. 2GiB (default 4GiB)")
    p.add_argument("--segment-size", help="bytes per segment file, e.g. 256MiB")
    p.add_argument(
        "--segment-init",
        choices=["zero", "fallocate", "sparse"],
        help="how segment files are preallocated (default zero)",
    )
    p.add_argument("--socket", help="unix socket path (default <data-dir>/sidecar.sock)")
    p.add_argument("--tcp", help="also listen on this loopback address, e.g. 127.0.0.1:50051")
    p.add_argument("--metrics-port", type=int, help="port of /metrics (0 = any free port)")
    p.add_argument("--metrics-host", help="address of /metrics (default 0.0.0.0)")
    p.add_argument("--policy", help="eviction policy (default: the store's default)")
    p.add_argument(
        "--durable", action="store_true", default=None, help="fsync block bytes before publishing"
    )
    p.add_argument("--lease-ttl", type=float, help="default lease lifetime, seconds")
    p.add_argument(
        "--restart-quarantine", type=float, help="seconds before reusing space after a restart"
    )
    p.add_argument("--verify-on-start", choices=["header", "full"], help="reconcile depth")
    p.add_argument(
        "--drain-max",
        type=float,
        help="after SIGTERM, serve on at most this many seconds while clients are "
        "connected to the unix socket (default 20; 0 = stop at once)",
    )
    p.add_argument(
        "--tenant-quota",
        type=float,
        help="largest share of capacity one tenant may hold, in (0, 1] (default 1: off)",
    )
    p.add_argument(
        "--shared-nodes",
        help="shared tier: Redis Cluster startup nodes host:port,host:port (default: none)",
    )
    p.add_argument(
        "--shared-write-policy",
        choices=["reused", "all"],
        help="blocks written to the shared tier: reused (default) or all",
    )
    p.add_argument("--shared-timeout", type=float, help="seconds per remote operation")
    p.add_argument(
        "--holdings-refresh",
        type=float,
        help="seconds between rebuilds of GET /dscache/holdings on the metrics port "
        "(0 = off; default 2)",
    )
    p.add_argument(
        "--kv-events-endpoint",
        help="publish the store's holdings as vLLM KV events on this ZeroMQ address, "
        "e.g. tcp://*:5557 (default: off)",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        help="serve replays of missed KV event batches on this address, e.g. tcp://*:5558",
    )
    p.add_argument(
        "--fault-injection",
        action="store_true",
        default=None,
        help="serve PUT/GET /debug/fault on the metrics port (chaos tests; never in production)",
    )


def settings_from_args(args: argparse.Namespace) -> SidecarSettings:
    """Builds settings from flags (when given) over env vars over defaults."""
    mapping = {
        "data_dir": "data_dir",
        "capacity": "capacity_bytes",
        "segment_size": "segment_bytes",
        "segment_init": "segment_init",
        "socket": "socket",
        "tcp": "tcp",
        "metrics_port": "metrics_port",
        "metrics_host": "metrics_host",
        "policy": "policy",
        "durable": "durable",
        "lease_ttl": "lease_ttl_s",
        "restart_quarantine": "restart_quarantine_s",
        "verify_on_start": "verify_on_start",
        "drain_max": "drain_max_s",
        "tenant_quota": "tenant_quota",
        "fault_injection": "fault_injection",
        "holdings_refresh": "holdings_refresh_s",
        "kv_events_endpoint": "kv_events_endpoint",
        "kv_events_replay_endpoint": "kv_events_replay_endpoint",
        "shared_nodes": "shared_nodes",
        "shared_write_policy": "shared_write_policy",
        "shared_timeout": "shared_timeout_s",
    }
    kwargs: dict[str, Any] = {}
    for flag, field in mapping.items():
        value = getattr(args, flag, None)
        if value is not None:
            kwargs[field] = value
    return SidecarSettings(**kwargs)
