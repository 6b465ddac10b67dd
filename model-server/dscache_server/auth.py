"""Who sent a request: its tenant comes from authentication, never from the client's say-so.

Contract:
    * With an API-key file (``--api-keys FILE``, a JSON object ``{API key: tenant
      name}``), tenancy is on: a request must carry ``Authorization: Bearer <key>``
      with a key of the file, else :class:`AuthError` 401 ``invalid_api_key``. Its
      tenant is the file's name for that key.
    * Without a file: the bearer key, hashed (never the key itself), else
      ``default``.
    * The tenant header (``X-Dscache-Tenant``) is trusted only together with the
      gateway token header (``X-Dscache-Gateway-Token``) equal to the configured
      gateway secret; then it names the tenant and no API key is needed (the
      gateway authenticated the client). A tenant header without a valid token,
      or a token that is not the secret, is a 401 ``untrusted_tenant_header``;
      with no secret configured, every tenant header is refused so. A client never
      silently lands in another tenant. ``Authenticator.is_gateway`` applies the same
      token check to routes only the gateway may use, ``Authenticator.is_internal``
      (the internal token, ``X-Dscache-Internal-Token``, or the gateway token) to
      routes for the router's picker.
    * Keys are compared through their SHA-256 digests (a dict of digests; the
      presented key is hashed first) and the gateway token with
      ``hmac.compare_digest``, so timing reveals nothing of a key or the secret.
    * The file is validated when read (:func:`read_key_file`: not an object, an
      empty or duplicate key, a key with white space, a tenant name outside
      :data:`TENANT_NAME` are errors naming the file and the entry, never a key).
      It is re-read when its ``stat`` changes (a rotated Kubernetes Secret updates
      the mounted file in place): one ``stat`` per request. A re-read that fails
      keeps the keys read before and logs the error once per change.
    * Every :class:`Principal` carries a metric label of bounded cardinality: the
      file's tenant names, ``default``, at most :data:`GATEWAY_LABEL_CAP` tenant
      names set by the gateway, and ``other`` for the rest (hashed keys included).

Pure: no HTTP framework; headers come as a mapping with lower-case names (as
Starlette's ``Headers`` answers any case).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dscache_sidecar.holdings import INTERNAL_TOKEN_HEADER

log = logging.getLogger(__name__)

#: A tenant name, in the key file or in a trusted tenant header.
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
#: The header a trusted gateway proves itself with.
GATEWAY_TOKEN_HEADER = "X-Dscache-Gateway-Token"  # noqa: S105 - a header name, not a secret
#: The tenant (and its label) of a request without a key when tenancy is off.
DEFAULT_TENANT = "default"
#: The label of every tenant without a label of its own.
OTHER_LABEL = "other"
#: Distinct gateway-set tenant names that get a label of their own, per process.
GATEWAY_LABEL_CAP = 32


class KeyFileError(ValueError):
    """The API-key file cannot be used; the message names the file and the problem."""


@dataclass(eq=False)
class AuthError(Exception):
    """A request that is refused before its body is read (401, or 400 for a bad name)."""

    status: int
    message: str
    code: str
    type_: str = "invalid_request_error"

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Principal:
    """The authenticated sender of a request.

    Attributes:
        tenant: the tenant id that selects the key chain (never a raw key).
        label: its value of the metrics' ``tenant`` label (bounded set).
    """

    tenant: str
    label: str


def tenant_from_api_key(api_key: str) -> str:
    """A tenant id for an API key that never reveals the key."""
    return "apikey:" + hashlib.sha256(api_key.encode()).hexdigest()[:32]


def tenant_id(name: str) -> str:
    """The tenant id of a named tenant (from the key file or a trusted gateway)."""
    return "tenant:" + name


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


class _Pairs(list[tuple[str, object]]):
    """A JSON object as its list of pairs: ``json.loads`` would keep the last of two
    equal keys silently, and the file's author must hear about it instead."""


def read_key_file(path: Path) -> dict[bytes, str]:
    """The key file as ``{sha256(key): tenant name}``.

    Raises:
        KeyFileError: naming ``path`` and the entry at fault (never a key).
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"API-key file {path}: cannot read it: {exc.strerror}") from None
    try:
        pairs = json.loads(raw, object_pairs_hook=_Pairs)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"API-key file {path}: not valid JSON: {exc}") from None
    if not isinstance(pairs, _Pairs):
        raise KeyFileError(
            f"API-key file {path}: must be a JSON object {{API key: tenant name}}, "
            f"got a JSON {_json_type(pairs)}"
        )
    if not pairs:
        raise KeyFileError(f"API-key file {path}: has no keys (every request would get 401)")
    return _digests(path, pairs)


def _json_type(value: object) -> str:
    names = {list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _digests(path: Path, pairs: list[tuple[str, object]]) -> dict[bytes, str]:
    out: dict[bytes, str] = {}
    seen: dict[bytes, int] = {}
    for n, (key, tenant) in enumerate(pairs, 1):
        where = f"API-key file {path}, entry {n}"
        if not key:
            raise KeyFileError(f"{where}: the API key is empty")
        if any(c.isspace() for c in key):
            raise KeyFileError(f"{where}: the API key contains white space")
        if not isinstance(tenant, str) or not TENANT_NAME.match(tenant):
            raise KeyFileError(
                f"{where}: tenant name {tenant!r} does not match {TENANT_NAME.pattern}"
            )
        digest = _digest(key)
        if digest in seen:
            raise KeyFileError(f"{where}: the same API key as entry {seen[digest]}")
        seen[digest] = n
        out[digest] = tenant
    return out


def _stat_signature(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)  # follows the ..data symlink of a mounted Secret
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)


@dataclass
class KeyFile:
    """The API keys of one file, re-read when the file changes."""

    path: Path
    _digests: dict[bytes, str] = field(default_factory=dict)
    _signature: tuple[int, int, int, int] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._digests = read_key_file(self.path)  # a bad file at start-up is an error
        self._signature = _stat_signature(self.path)

    def tenants(self) -> tuple[str, ...]:
        """The tenant names of the keys read last, sorted, each once."""
        return tuple(sorted(set(self._digests.values())))

    def tenant_of(self, key: str) -> str | None:
        """The tenant name of ``key``, None for an unknown key."""
        self._refresh()
        return self._digests.get(_digest(key))

    def _refresh(self) -> None:
        try:
            signature = _stat_signature(self.path)
        except OSError as exc:
            signature = None
            error: str | None = f"API-key file {self.path}: cannot stat it: {exc.strerror}"
        else:
            error = None
        with self._lock:
            if signature == self._signature:
                return
            self._signature = signature
            if error is None:
                try:
                    self._digests = read_key_file(self.path)
                    log.info("API keys re-read from %s: %d keys", self.path, len(self._digests))
                    return
                except KeyFileError as exc:
                    error = str(exc)
            log.error("%s; keeping the %d keys read before", error, len(self._digests))


@dataclass
class _Labels:
    """Metric labels of gateway-set tenants: the first ``cap`` names, then ``other``."""

    cap: int
    names: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def of(self, name: str) -> str:
        with self.lock:
            if name in self.names:
                return name
            if len(self.names) < self.cap:
                self.names.add(name)
                return name
        return OTHER_LABEL


class Authenticator:
    """Turns a request's headers into a :class:`Principal`, or refuses it."""

    def __init__(
        self,
        *,
        key_file: Path | None,
        gateway_secret: str = "",
        internal_token: str = "",
        tenant_header: str = "X-Dscache-Tenant",
        label_cap: int = GATEWAY_LABEL_CAP,
    ) -> None:
        """Reads ``key_file`` (None: tenancy off).

        Raises:
            KeyFileError: the file cannot be used.
        """
        self.keys = KeyFile(key_file) if key_file is not None else None
        self._secret = _digest(gateway_secret) if gateway_secret else None
        self._internal = _digest(internal_token) if internal_token else None
        self._internal_header = INTERNAL_TOKEN_HEADER.lower()
        self._tenant_header = tenant_header.lower()
        self._token_header = GATEWAY_TOKEN_HEADER.lower()
        self._labels = _Labels(label_cap)

    @property
    def tenancy(self) -> bool:
        """Whether every request needs a known API key."""
        return self.keys is not None

    def known_labels(self) -> tuple[str, ...]:
        """The tenant labels known before any request (metrics show them as 0)."""
        return self.keys.tenants() if self.keys is not None else (DEFAULT_TENANT,)

    @property
    def has_gateway_secret(self) -> bool:
        """Whether a gateway secret is configured (else no request is the gateway's)."""
        return self._secret is not None

    def is_gateway(self, headers: Mapping[str, str]) -> bool:
        """Whether these headers carry the gateway token (compared in constant time)."""
        return self._is_secret(headers.get(self._token_header))

    @property
    def has_internal_token(self) -> bool:
        """Whether the routes for the router's picker ask for a token."""
        return self._internal is not None

    def is_internal(self, headers: Mapping[str, str]) -> bool:
        """Whether these headers may read what only the router's picker (or the
        gateway) may: the internal token, or the gateway token (constant time)."""
        token = headers.get(self._internal_header)
        internal = (
            self._internal is not None
            and token is not None
            and hmac.compare_digest(_digest(token), self._internal)
        )
        return internal or self.is_gateway(headers)

    def _is_secret(self, token: str | None) -> bool:
        return (
            self._secret is not None
            and token is not None
            and hmac.compare_digest(_digest(token), self._secret)
        )

    def authenticate(self, headers: Mapping[str, str]) -> Principal:
        """The sender of a request with these headers.

        Raises:
            AuthError: see the module's contract.
        """
        claimed = headers.get(self._tenant_header)
        token = headers.get(self._token_header)
        if claimed is not None or token is not None:
            return self._from_gateway(claimed, token, headers)
        return self._from_key(_bearer(headers))

    def _from_gateway(
        self, claimed: str | None, token: str | None, headers: Mapping[str, str]
    ) -> Principal:
        if not self._is_secret(token):
            raise AuthError(
                401,
                f"the {self._tenant_header} and {self._token_header} headers are accepted only "
                "from the trusted gateway; send your API key as Authorization: Bearer <key>",
                code="untrusted_tenant_header",
            )
        if claimed is None:
            return self._from_key(_bearer(headers))
        if not TENANT_NAME.match(claimed):
            raise AuthError(
                400,
                f"the {self._tenant_header} header must match {TENANT_NAME.pattern}",
                code="invalid_tenant",
            )
        return Principal(tenant_id(claimed), self._labels.of(claimed))

    def _from_key(self, key: str | None) -> Principal:
        if self.keys is None:
            if key is None:
                return Principal(DEFAULT_TENANT, DEFAULT_TENANT)
            return Principal(tenant_from_api_key(key), OTHER_LABEL)
        if key is None:
            raise AuthError(
                401,
                "no API key: send it as Authorization: Bearer <key>",
                code="invalid_api_key",
            )
        name = self.keys.tenant_of(key)
        if name is None:
            raise AuthError(401, "incorrect API key provided", code="invalid_api_key")
        return Principal(tenant_id(name), name)


def _bearer(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    scheme, _, key = auth.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None
