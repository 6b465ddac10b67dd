"""The internal token (issue 30, finding 2): the router's picker reads what the model pods
hold, nobody else does.

With a generated tenant salt, the Secret ``<name>-tenant-salt`` also holds an internal
token derived from the salt, and the model server, the sidecar and the picker get it
(the server and sidecar then answer key info and holdings filters to its bearer only,
``tests/server/test_auth.py``, ``tests/sidecar/test_holdings.py``). Resources stored
with another salt source render exactly as before (no restart on upgrade).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any

from dscache_operator.desired import Owner, model_deployment, router_deployment
from dscache_operator.desired.tenancy import tenant_salt_secret
from dscache_operator.spec import parse_spec
from spec_helpers import status_for

OWNER = Owner("chat", "prod", "u")
BASE: dict[str, Any] = {"model": {"preset": "tiny-gqa"}}
REF = {"name": "chat-tenant-salt", "key": "internal-token", "optional": True}


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("valueFrom") for e in container.get("env", [])}


def _containers(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in obj["spec"]["template"]["spec"]["containers"]}


def test_a_generated_salt_hands_the_internal_token_to_server_sidecar_and_picker() -> None:
    spec = parse_spec(BASE)
    assert spec.tenant_salt.source == "generated"
    pod = _containers(model_deployment(OWNER, spec, status_for(spec), "blue"))
    assert _env(pod["server"])["DSCACHE_SERVER_INTERNAL_TOKEN"] == {"secretKeyRef": REF}
    assert _env(pod["sidecar"])["DSCACHE_SIDECAR_INTERNAL_TOKEN"] == {"secretKeyRef": REF}
    router = _containers(router_deployment(OWNER, spec))
    assert _env(router["picker"])["DSCACHE_PICKER_INTERNAL_TOKEN"] == {"secretKeyRef": REF}
    assert "env" not in router["nginx"] or "DSCACHE_PICKER_INTERNAL_TOKEN" not in _env(
        router["nginx"]
    )

    secret = tenant_salt_secret(OWNER, "s" * 64)
    token = base64.b64decode(secret["data"]["internal-token"]).decode()
    want = hmac.new(b"s" * 64, b"dscache/internal-token/v1", hashlib.sha256).hexdigest()
    assert token == want and ("s" * 64) not in token


def test_a_vllm_pod_gets_the_token_for_its_session_ledger() -> None:
    # dscache_vllm.ledger answers the router's picker only with this token.
    spec = parse_spec({**BASE, "engine": "vllm", "model": {"path": "/models/ds"}})
    pod = _containers(model_deployment(OWNER, spec, status_for(spec), "blue"))
    assert _env(pod["server"])["DSCACHE_VLLM_INTERNAL_TOKEN"] == {"secretKeyRef": REF}
    assert pod["server"]["args"][:2] == ["vllm", "serve"]


def test_other_salt_sources_render_no_token() -> None:
    for salt in ({"source": "namespace"}, {"source": "none"}):
        spec = parse_spec({**BASE, "tenantSalt": salt})
        pod = _containers(model_deployment(OWNER, spec, status_for(spec), "blue"))
        for name, container in pod.items():
            assert not any("INTERNAL_TOKEN" in k for k in _env(container)), name
        router = _containers(router_deployment(OWNER, spec))
        assert not any("INTERNAL_TOKEN" in k for k in _env(router["picker"]))
