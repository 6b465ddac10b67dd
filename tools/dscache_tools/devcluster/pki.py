"""Certificates and keys for one dev cluster, generated on the fly.

Contract:
    * ``generate(directory)`` writes a fresh CA, an API-server serving
      certificate valid for loopback and the in-cluster ``kubernetes`` names,
      an admin client certificate in group ``system:masters``, and the
      service-account signing key pair. Nothing is reused across clusters.
    * Keys are ECDSA P-256 (fast to generate, accepted by every component) and
      written with mode 0600; certificates are PEM.
    * Certificates are valid for 30 days: a dev cluster is short-lived.
    * ``node_credentials`` issues, from the same CA, what a real kubelet needs:
      a client certificate ``system:node:<name>`` in group ``system:nodes`` (the
      Node authorizer's identity) and a serving certificate for the node's IP.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=30)

#: Names a client inside the cluster would use for the API server.
_SERVICE_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class Pki:
    """Paths of one cluster's PEM files."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    service_account_key: Path
    service_account_pub: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def _certificate(
    *,
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    issuer: x509.Name,
    now: dt.datetime,
    ca: bool,
) -> x509.CertificateBuilder:
    """What every certificate here shares: validity, basic constraints, key usage."""
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                # A leaf's key encrypts (TLS key transport); a CA's key signs certificates.
                key_encipherment=not ca,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )


#: A CA that signs: its certificate and key.
_Ca = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


def _issue(
    ca: _Ca,
    paths: tuple[Path, Path],
    *,
    subject: x509.Name,
    usage: x509.ObjectIdentifier,
    san: x509.SubjectAlternativeName | None = None,
) -> tuple[Path, Path]:
    """Writes a new key and a leaf certificate for it signed by ``ca``; returns ``paths``.

    Args:
        ca: The signing CA.
        paths: ``(certificate, key)`` to write.
        subject: The certificate's subject.
        usage: Server or client authentication.
        san: Subject alternative names (serving certificates).
    """
    ca_cert, ca_key = ca
    key = _key()
    builder = _certificate(
        subject=subject,
        public_key=key.public_key(),
        issuer=ca_cert.subject,
        now=dt.datetime.now(dt.UTC),
        ca=False,
    ).add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if san is not None:
        builder = builder.add_extension(san, critical=False)
    _write_key(paths[1], key)
    _write_cert(paths[0], builder.sign(ca_key, hashes.SHA256()))
    return paths


def generate(
    directory: Path, service_ip: str = "10.96.0.1", extra_ips: tuple[str, ...] = ()
) -> Pki:
    """Writes a new CA and every certificate and key the cluster needs.

    Args:
        directory: Created if missing; existing files are overwritten.
        service_ip: ClusterIP of the ``kubernetes`` Service (first address of
            the service range), added to the serving certificate.
        extra_ips: More addresses the API server serves on (the node bridge
            address pods reach it through), added to the serving certificate.

    Returns:
        The paths of the written files.
    """
    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    pki = Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        service_account_key=directory / "sa.key",
        service_account_pub=directory / "sa.pub",
    )

    ca_key = _key()
    ca_name = _name("dscache-dev-ca")
    ca_cert = (
        _certificate(
            subject=ca_name, public_key=ca_key.public_key(), issuer=ca_name, now=now, ca=True
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(pki.ca_key, ca_key)
    _write_cert(pki.ca_cert, ca_cert)

    ca = (ca_cert, ca_key)
    san = x509.SubjectAlternativeName(
        [x509.DNSName(name) for name in _SERVICE_NAMES]
        + [
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address(service_ip)),
        ]
        + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in extra_ips]
    )
    _issue(
        ca,
        (pki.serving_cert, pki.serving_key),
        subject=_name("kube-apiserver"),
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        san=san,
    )
    _issue(
        ca,
        (pki.admin_cert, pki.admin_key),
        subject=_name("dscache-dev-admin", "system:masters"),
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
    )

    sa_key = _key()
    _write_key(pki.service_account_key, sa_key)
    pki.service_account_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


@dataclass(frozen=True)
class NodeCredentials:
    """Paths of one real node's certificates and keys."""

    client_cert: Path
    client_key: Path
    serving_cert: Path
    serving_key: Path


def _load_ca(pki: Pki) -> _Ca:
    cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{pki.ca_key} is not an EC key")
    return cert, key


def node_credentials(pki: Pki, directory: Path, node: str, ip: str) -> NodeCredentials:
    """Issues a kubelet's client and serving certificates from the cluster CA.

    Args:
        pki: The cluster's PKI (its CA signs).
        directory: Where to write the files (created if missing).
        node: Node name; the client identity is ``system:node:<node>``.
        ip: The node's InternalIP, the serving certificate's address.
    """
    directory.mkdir(parents=True, exist_ok=True)
    creds = NodeCredentials(
        client_cert=directory / "kubelet-client.crt",
        client_key=directory / "kubelet-client.key",
        serving_cert=directory / "kubelet.crt",
        serving_key=directory / "kubelet.key",
    )
    client_credentials(pki, directory, "kubelet-client", f"system:node:{node}", "system:nodes")
    _issue(
        _load_ca(pki),
        (creds.serving_cert, creds.serving_key),
        subject=_name(node),
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        san=x509.SubjectAlternativeName(
            [x509.DNSName(node), x509.IPAddress(ipaddress.ip_address(ip))]
        ),
    )
    return creds


def client_credentials(
    pki: Pki, directory: Path, name: str, common_name: str, organization: str | None = None
) -> tuple[Path, Path]:
    """Issues a client certificate ``common_name`` (in ``organization``) from the cluster CA.

    Returns:
        ``(cert, key)`` paths, ``<directory>/<name>.crt`` and ``.key``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    return _issue(
        _load_ca(pki),
        (directory / f"{name}.crt", directory / f"{name}.key"),
        subject=_name(common_name, organization),
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
    )
