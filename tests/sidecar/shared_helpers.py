"""Helpers of the shared-tier tests (imported by name): a pod on a real Redis Cluster,
waiting for its writes, a returning request, TLS files, and a block's record."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dscache_sidecar.blockstore import tenant_bytes
from dscache_sidecar.index import BlockRecord
from dscache_sidecar.sharedvalue import ValueFormat
from dscache_tools.polling import wait_until
from dscache_tools.rediscluster import LocalRedisCluster, TlsFiles
from sidecar_helpers import Sidecar

#: The names and values of pods without a signing key or prefix (the defaults).
UNSIGNED = ValueFormat()


def pod(
    make_sidecar: Callable[..., Sidecar],
    c: LocalRedisCluster,
    *,
    connected: bool = True,
    **kw: Any,
) -> Sidecar:
    """A daemon on its own (empty) data directory with ``c`` as its shared tier.

    Timeouts are generous unless a test is about them: on a loaded machine a first
    call (connection, slot map) can outlast the 0.25 s default, and these tests
    check what is found, not how fast. With ``connected`` it is returned once its
    background connect is done (``dscache_sidecar_remote_up`` 1), as a pod is
    before it takes traffic: a read made earlier is a miss by design.
    """
    kw.setdefault("shared_timeout_s", 3.0)
    kw.setdefault("shared_fetch_budget_s", 10.0)
    p = make_sidecar(shared_nodes=c.nodes, **kw)
    if connected:
        wait_until(
            "the sidecar's shared tier to connect",
            lambda: p.metric("dscache_sidecar_remote_up") == 1,
            30,
        )
    return p


def settle(*pods: Sidecar) -> None:
    for p in pods:
        assert p.running is not None and p.running.shared is not None
        assert p.running.shared.wait_idle(20.0), "shared-tier writes did not finish"


def reuse(p: Sidecar, tenant: str, keys: list[bytes]) -> None:
    """A returning request: leases (hits) the whole chain on ``p``."""
    with p.c.load(tenant, keys) as loaded:
        assert len(loaded.keys) == len(keys)


def tls_files(where: Path, name: str) -> TlsFiles:
    """A CA and a node certificate for 127.0.0.1 signed by it (PEM files)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    where.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "redis")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(where / "node.crt", where / "node.key", where / "ca.crt")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(pem_key(key))
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return files


def record(key: bytes, parent: bytes, tenant: str, data: bytes, **kw: Any) -> BlockRecord:
    """The record of a float32 block of ``data`` (``kw`` overrides a field)."""
    from dscache_sidecar.codec import DTYPE_CODES
    from dscache_sidecar.segments import checksum

    fields: dict[str, Any] = {
        "key": key,
        "segment": 0,
        "offset": 0,
        "extent_bytes": 4096,
        "stored_bytes": len(data),
        "raw_bytes": len(data),
        "checksum": checksum(data),
        "codec": 0,
        "dtype_code": DTYPE_CODES["float32"],
        "shape": (len(data) // 4,),
        "tenant": tenant_bytes(tenant),
        "parent": parent,
        "created_ms": 0,
    }
    fields.update(kw)
    return BlockRecord(**fields)
