"""The generated tenant salt: Secret ``<name>-tenant-salt`` (pure, given the salt).

With ``spec.tenantSalt.source: generated`` (the default) the model servers'
``DSCACHE_SERVER_TENANT_SECRET`` comes from this Secret's ``salt`` key, so the
cache keys of one deployment cannot be computed by anyone who cannot read it
(the namespace name, the old default, is public). The reconciler creates the
Secret once with a fresh random salt (:func:`new_salt`) and never updates it:
a salt that changed would turn every cached block into a miss. It is never
read back by the operator (which may create Secrets but not read them); the
kubelet hands it to the pods. Its ownerReference deletes it with the resource.
Its ``internal-token`` key (derived from the salt) goes to the model server, the
sidecar and the router's picker: the picker shows it to read the key info and the
holdings filters, which nobody else gets.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

from dscache_operator.desired.common import Obj, Owner, labels, meta
from dscache_operator.desired.model import (
    INTERNAL_TOKEN_KEY,
    TENANT_SALT_KEY,
    tenant_salt_secret_name,
)


def new_salt() -> str:
    """32 random bytes as hex: a salt nobody can guess."""
    return secrets.token_hex(32)


def internal_token(salt: str) -> str:
    """The internal token of a salt: HMAC-SHA256 under the salt, hex. The picker shows
    it to read key info and filters; it tells nothing of the salt."""
    return hmac.new(salt.encode(), b"dscache/internal-token/v1", hashlib.sha256).hexdigest()


def tenant_salt_secret(owner: Owner, salt: str) -> Obj:
    """Secret ``<name>-tenant-salt`` holding ``salt`` under the key ``salt`` and its
    :func:`internal_token` under ``internal-token``."""

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": meta(owner, tenant_salt_secret_name(owner), labels(owner, "tenancy", "all")),
        "immutable": True,
        "data": {TENANT_SALT_KEY: b64(salt), INTERNAL_TOKEN_KEY: b64(internal_token(salt))},
    }
