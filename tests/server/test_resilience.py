"""A cache problem never fails a request: sidecar killed mid-test, tenants isolated."""

from __future__ import annotations

from collections.abc import Callable

import openai
from dscache_server.tokenizer import DeepSeekTokenizer
from srv_helpers import LiveServer, SidecarDaemon, random_text

from dscache.keys import KeyChain, tenant_salt


def chat(srv: LiveServer, text: str, **headers: str) -> int:
    """Sends one chat; returns its cached_tokens (the request must succeed)."""
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0, default_headers=headers)
    resp = c.chat.completions.create(
        model="mini-gqa", messages=[{"role": "user", "content": text}], max_tokens=2
    )
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    srv.runtime.cache.wait_stored(30)
    return resp.usage.prompt_tokens_details.cached_tokens or 0


def fallbacks(srv: LiveServer) -> float:
    return sum(
        srv.metric("dscache_server_cache_fallbacks_total", reason=r)
        for r in ("unavailable", "timeout", "circuit_open", "error", "corrupt", "short_load")
    )


def test_sidecar_killed_then_back(
    live_server: Callable[..., LiveServer],
    sidecar: SidecarDaemon,
    tokenizer: DeepSeekTokenizer,
) -> None:
    srv = live_server()
    a = random_text(tokenizer, 100, seed=31)
    assert chat(srv, a) == 0
    assert chat(srv, a) > 0  # the cache works

    sidecar.kill()
    before = fallbacks(srv)
    for i in range(3):
        assert chat(srv, a + f" variant {i}") == 0  # succeeds by recomputing
    assert fallbacks(srv) > before
    assert srv.metric("dscache_server_cache_fallbacks_total", reason="unavailable") >= 1

    sidecar.start()
    c = random_text(tokenizer, 100, seed=32)
    chat(srv, c)  # may still be inside the cool-down; stores once the client is back
    assert chat(srv, c) > 0 or chat(srv, c) > 0  # hits resume


def test_tenants_never_share_blocks(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer
) -> None:
    srv = live_server(gateway_secret="gw")
    text = random_text(tokenizer, 100, seed=41)

    def as_tenant(name: str) -> dict[str, str]:
        # The tenant header of the trusted gateway (with its token).
        return {"X-Dscache-Tenant": name, "X-Dscache-Gateway-Token": "gw"}

    assert chat(srv, text, **as_tenant("alpha")) == 0
    assert chat(srv, text, **as_tenant("alpha")) > 0
    # Same prompt, other tenants (by header and by API key): no hit, ever.
    assert chat(srv, text, **as_tenant("beta")) == 0
    assert chat(srv, text) == 0  # tenant from the API key "k"

    ids = tokenizer.encode(text)
    fp = srv.runtime.engine.fingerprint
    alpha = KeyChain(fp, tenant_salt("tenant:alpha")).keys(ids)
    beta = KeyChain(fp, tenant_salt("tenant:beta")).keys(ids)
    assert alpha and not set(alpha) & set(beta)
    store = srv.runtime.cache.store
    assert store is not None
    # The sidecar also isolates by tenant label: alpha's keys are not visible as beta.
    assert store.lookup(KeyChain(fp, tenant_salt("tenant:beta")).tenant, alpha) == 0
