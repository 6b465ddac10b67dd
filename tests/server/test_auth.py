"""Tenant identity comes from authentication, never from a client's say-so.

Real HTTP through the real app (uvicorn), the real sidecar for the cache hits, and
the key file on disk, rotated as Kubernetes rotates a mounted Secret (a new file
swapped in with a rename).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from dscache_server.auth import Authenticator, KeyFileError, Principal, read_key_file
from dscache_server.tokenizer import ChatMessage, DeepSeekTokenizer
from srv_helpers import LiveServer, random_text

from dscache.cli import main
from dscache.keys import KeyChain, tenant_salt
from dscache.routing import answered_key, conversation_key, previous_turn_keys

KEYS = {"sk-alpha-1": "alpha", "sk-beta-1": "beta"}
GATEWAY = "gw-secret-1"


def write_keys(path: Path, keys: dict[str, str] | str) -> Path:
    """Writes the key file as the kubelet updates a Secret: a new file renamed over."""
    tmp = path.with_suffix(".new")
    tmp.write_text(keys if isinstance(keys, str) else json.dumps(keys))
    os.replace(tmp, path)
    return path


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    return write_keys(tmp_path / "keys.json", KEYS)


def chat(srv: LiveServer, text: str, key: str | None = None, **headers: str) -> httpx.Response:
    """One chat completion (2 tokens), its stores flushed before returning."""
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": text}], "max_tokens": 2},
        headers=headers,
        timeout=120,
    )
    srv.runtime.cache.wait_stored(30)
    return r


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def assert_refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err.pop("message")
    assert err == {"type": "invalid_request_error", "param": None, "code": code}


# -- the key file


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("[1, 2]", "must be a JSON object"),
        ("{}", "has no keys"),
        ("{not json", "not valid JSON"),
        ('{"": "alpha"}', "entry 1: the API key is empty"),
        ('{"sk-a": "alpha", "sk b": "beta"}', "entry 2: the API key contains white space"),
        ('{"sk-a": "al pha"}', "tenant name 'al pha' does not match"),
        ('{"sk-a": 7}', "tenant name 7 does not match"),
        ('{"sk-a": "alpha", "sk-a": "beta"}', "entry 2: the same API key as entry 1"),
    ],
)
def test_a_bad_key_file_names_the_file_and_the_problem_never_a_key(
    tmp_path: Path, content: str, problem: str
) -> None:
    path = write_keys(tmp_path / "keys.json", content)
    with pytest.raises(KeyFileError) as exc:
        read_key_file(path)
    assert str(path) in str(exc.value) and problem in str(exc.value)
    assert "sk-a" not in str(exc.value)


def test_dscache_server_with_a_bad_key_file_does_not_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = write_keys(tmp_path / "keys.json", '{"sk-a": "no/slash"}')
    with caplog.at_level(logging.ERROR):
        assert main(["server", "--api-keys", str(bad), "--port", "0"]) == 2
    assert str(bad) in caplog.text and "'no/slash' does not match" in caplog.text
    with caplog.at_level(logging.ERROR):
        assert main(["server", "--api-keys", str(tmp_path / "absent.json")]) == 2
    assert "absent.json: cannot read it" in caplog.text


def test_gateway_tenant_labels_are_capped() -> None:
    auth = Authenticator(key_file=None, gateway_secret=GATEWAY, label_cap=3)
    labels = {
        auth.authenticate({"x-dscache-tenant": f"t{i}", "x-dscache-gateway-token": GATEWAY}).label
        for i in range(10)
    }
    assert labels == {"t0", "t1", "t2", "other"}
    # The tenant itself is never capped: the cap is only on the metric label.
    p = auth.authenticate({"x-dscache-tenant": "t9", "x-dscache-gateway-token": GATEWAY})
    assert p == Principal("tenant:t9", "other")


# -- the server


def test_tenancy_on_unknown_or_missing_key_gets_401_known_key_200(
    live_server: Callable[..., LiveServer], key_file: Path
) -> None:
    srv = live_server(api_keys_file=key_file)
    url = srv.url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = httpx.post(url, json=body)
    assert_refused(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    assert_refused(
        httpx.post(url, json=body, headers={"Authorization": "Bearer sk-nope"}),
        401,
        "invalid_api_key",
    )
    # Refused before the body is read: a malformed body still gets the 401.
    r = httpx.post(url, content=b"{oops", headers={"Authorization": "Bearer sk-nope"})
    assert_refused(r, 401, "invalid_api_key")
    ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-alpha-1", max_retries=0)
    assert ok.chat.completions.create(model="mini-gqa", messages=body["messages"], max_tokens=1)
    assert [m.id for m in ok.models.list()] == ["mini-gqa"]
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.models.list()
    assert exc.value.code == "invalid_api_key"
    # Probes and metrics stay open.
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(srv.url + path).status_code == 200
    assert srv.metric("dscache_server_requests_total", code="401", tenant="other") == 3
    assert srv.metric("dscache_server_requests_total", code="200", tenant="alpha") == 1
    # The file's tenants scrape as zeros before their first request.
    assert "beta" in srv.label_values("dscache_server_prompt_tokens_total", "tenant")


@pytest.mark.parametrize("tenancy", ["api-key file", "gateway secret only"])
def test_a_spoofed_tenant_header_gets_no_hit_on_another_tenants_prompt(
    live_server: Callable[..., LiveServer],
    tokenizer: DeepSeekTokenizer,
    key_file: Path,
    tenancy: str,
) -> None:
    if tenancy == "api-key file":
        srv = live_server(api_keys_file=key_file, gateway_secret=GATEWAY)
        as_alpha: dict[str, str] = {"Authorization": "Bearer sk-alpha-1"}
        mallory = "sk-beta-1"
    else:
        srv = live_server(gateway_secret=GATEWAY)
        as_alpha = {"X-Dscache-Tenant": "alpha", "X-Dscache-Gateway-Token": GATEWAY}
        mallory = "sk-mallory"
    # The module's sidecar outlives a case: each case its own prompt.
    text = random_text(tokenizer, 100, seed=71 if tenancy == "api-key file" else 73)
    assert cached(chat(srv, text, **as_alpha)) == 0
    assert cached(chat(srv, text, **as_alpha)) > 0  # alpha's blocks are there

    spoofs = [
        {"X-Dscache-Tenant": "alpha"},
        {"X-Dscache-Tenant": "alpha", "X-Dscache-Gateway-Token": "guess"},
        {"X-Dscache-Tenant": "alpha", "X-Dscache-Gateway-Token": ""},
    ]
    for spoof in spoofs:
        r = chat(srv, text, mallory, **spoof)
        assert_refused(r, 401, "untrusted_tenant_header")
    # Mallory's own tenant: a miss, as for any other tenant.
    assert cached(chat(srv, text, mallory)) == 0
    reused = srv.metric("dscache_server_prompt_tokens_total", source="reused", tenant="alpha")
    assert reused > 0
    assert srv.metric("dscache_server_prompt_tokens_total", source="reused") == reused


def test_the_gateway_sets_the_tenant_of_the_key_files_name(
    live_server: Callable[..., LiveServer], tokenizer: DeepSeekTokenizer, key_file: Path
) -> None:
    srv = live_server(api_keys_file=key_file, gateway_secret=GATEWAY)
    text = random_text(tokenizer, 100, seed=72)
    via_gateway = {"X-Dscache-Tenant": "alpha", "X-Dscache-Gateway-Token": GATEWAY}
    assert cached(chat(srv, text, **via_gateway)) == 0
    # The same tenant by its API key finds the blocks the gateway's request stored.
    assert cached(chat(srv, text, "sk-alpha-1")) > 0
    # ... and another tenant does not.
    assert cached(chat(srv, text, "sk-beta-1")) == 0
    # Stored under the chain of tenant "alpha", as the key contract derives it.
    chain = KeyChain(srv.runtime.engine.fingerprint, tenant_salt("tenant:alpha"))
    ids = tokenizer.apply_chat_template([ChatMessage("user", text)])
    store = srv.runtime.cache.store
    assert store is not None and store.lookup(chain.tenant, chain.keys(ids)) > 0
    # A token alone (no tenant header) falls back to the API key.
    assert cached(chat(srv, text, "sk-beta-1", **{"X-Dscache-Gateway-Token": GATEWAY})) > 0
    # A bad tenant name from the gateway is a 400, never a silent other tenant.
    r = chat(srv, text, **{"X-Dscache-Tenant": "../x", "X-Dscache-Gateway-Token": GATEWAY})
    assert_refused(r, 400, "invalid_tenant")


def test_a_rotated_key_file_takes_effect_without_a_restart(
    live_server: Callable[..., LiveServer], key_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    srv = live_server(api_keys_file=key_file)

    def status(key: str) -> int:
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        return r.status_code

    assert (status("sk-alpha-1"), status("sk-gamma-1")) == (200, 401)
    write_keys(key_file, {"sk-alpha-2": "alpha", "sk-gamma-1": "gamma"})
    assert (status("sk-alpha-1"), status("sk-alpha-2"), status("sk-gamma-1")) == (401, 200, 200)
    # A broken rotation keeps the keys read before, and says so.
    with caplog.at_level(logging.ERROR):
        write_keys(key_file, "{broken")
        assert status("sk-gamma-1") == 200
    assert "not valid JSON" in caplog.text and "keeping the 2 keys" in caplog.text


def test_tenant_label_values_stay_bounded(live_server: Callable[..., LiveServer]) -> None:
    srv = live_server(gateway_secret=GATEWAY)
    url = srv.url + "/v1/completions"
    body = {"prompt": "hello", "max_tokens": 1}
    with httpx.Client(timeout=60) as c:
        for i in range(100):  # 100 distinct API keys: 100 tenants, no tenancy
            assert c.post(url, json=body, headers={"Authorization": f"Bearer k{i}"}).is_success
        for i in range(40):  # 40 distinct gateway-set tenants, cap 32
            gw = {"X-Dscache-Tenant": f"team{i}", "X-Dscache-Gateway-Token": GATEWAY}
            assert c.post(url, json=body, headers=gw).is_success
        assert c.post(url, json=body).is_success  # no key: default
    for name in ("dscache_server_requests_total", "dscache_server_prompt_tokens_total"):
        values = srv.label_values(name, "tenant")
        assert values == {"default", "other"} | {f"team{i}" for i in range(32)}, name
    text = httpx.get(srv.url + "/metrics").text
    assert "k17" not in text and "apikey:" not in text


def test_keyinfo_gives_the_anonymous_root_only_when_tenancy_is_off(
    live_server: Callable[..., LiveServer], key_file: Path
) -> None:
    # The router's picker computes keys of anonymous requests with it (tenant secret applied).
    srv = live_server(tenant_secret="ns-a")
    info = httpx.get(srv.url + "/dscache/keyinfo").json()
    rt = srv.runtime
    assert info["root"] == rt.chain_for("default").root.hex()
    assert info["block_tokens"] == rt.fingerprint.block_tokens
    assert info["fingerprint"] == rt.fingerprint.digest().hex()
    # With API keys there is no anonymous tenant, and a tenant's root is not for the asking.
    assert (
        httpx.get(live_server(api_keys_file=key_file).url + "/dscache/keyinfo").json()["root"]
        is None
    )


def test_with_an_internal_token_keyinfo_and_the_template_filter_are_the_pickers(
    live_server: Callable[..., LiveServer],
) -> None:
    # The root lets whoever guesses a prompt compute its keys; the filter says whether
    # they are cached. With a token, only the picker (or the gateway) gets either.
    srv = live_server(tenant_secret="ns-a", internal_token="picker-1", gateway_secret=GATEWAY)
    for path in ("/dscache/keyinfo", "/dscache/templates/filter"):
        for headers in ({}, {"X-Dscache-Internal-Token": "guess"}, {"Authorization": "Bearer x"}):
            assert_refused(
                httpx.get(srv.url + path, headers=headers), 401, "invalid_internal_token"
            )
        for good in (
            {"X-Dscache-Internal-Token": "picker-1"},
            {"X-Dscache-Gateway-Token": GATEWAY},
        ):
            assert httpx.get(srv.url + path, headers=good, timeout=30).status_code == 200
    info = httpx.get(srv.url + "/dscache/keyinfo", headers={"X-Dscache-Internal-Token": "picker-1"})
    assert info.json()["root"] == srv.runtime.chain_for("default").root.hex()
    # The probes and the API are as they were.
    assert httpx.get(srv.url + "/health").status_code == 200
    assert cached(chat(srv, "hello there")) == 0


def test_the_session_ledger_tells_the_picker_which_sessions_this_pod_served(
    live_server: Callable[..., LiveServer], key_file: Path
) -> None:
    # Router replicas ask the pods where a session lives: only the picker may ask.
    srv = live_server(internal_token="picker-1", api_keys_file=key_file)
    shown = {"X-Dscache-Internal-Token": "picker-1"}
    url = srv.url + "/dscache/sessions/"
    assert_refused(httpx.get(url + "conv/1"), 401, "invalid_internal_token")
    unknown = httpx.get(url + "conv/1", headers=shown)
    assert (unknown.status_code, unknown.json()) == (404, {"inflight": 0})
    # A refused caller places no session here.
    refused = chat(srv, "hello there", "not-a-key", **{"X-Session-ID": "conv/1"})
    assert refused.status_code == 401
    assert httpx.get(url + "conv/1", headers=shown).status_code == 404
    answer = chat(srv, "hello there", "sk-alpha-1", **{"X-Session-ID": "conv/1"})
    # Every answer reports the pod's load to the router (it is not in flight any more).
    assert answer.headers["X-Dscache-Inflight"] == "0"
    known = httpx.get(url + "conv%2F1", headers=shown)
    assert known.status_code == 200
    assert known.json()["inflight"] == 0 and 0 <= known.json()["age_s"] < 60
    assert httpx.get(url + "conv/2", headers=shown).status_code == 404


def test_the_conversation_ledger_knows_the_public_chats_this_pod_served(
    live_server: Callable[..., LiveServer], key_file: Path
) -> None:
    # A turn that lost its session id is placed where its previous turn went: the pod
    # records each public chat request's messages by their digest, for the picker.
    srv = live_server(internal_token="picker-1")
    shown = {"X-Dscache-Internal-Token": "picker-1"}
    url = srv.url + "/dscache/conversations/"
    messages = [{"role": "user", "content": "hello there"}]
    key = conversation_key(messages)
    assert key is not None
    assert_refused(httpx.get(url + key), 401, "invalid_internal_token")
    assert httpx.get(url + key, headers=shown).status_code == 404
    answer = chat(srv, "hello there")
    said = answer.json()["choices"][0]["message"]["content"]
    nxt = [*messages, {"role": "assistant", "content": said}, {"role": "user", "content": "?"}]
    known = httpx.get(url + key, headers=shown)
    assert known.status_code == 200 and 0 <= known.json()["age_s"] < 60
    # What the picker asks for the next turn: the messages with the answer they got
    # (what tells this conversation from one that opened alike), then without it.
    with_answer, alone = previous_turn_keys(nxt)
    assert alone == key and with_answer == answered_key(messages, said) != key
    assert httpx.get(url + with_answer, headers=shown).status_code == 200
    # Another answer to the same messages is another conversation.
    other = answered_key(messages, said + " more")
    assert httpx.get(url + str(other), headers=shown).status_code == 404
    # A streamed answer too: the key of the text its chunks carried, known before the
    # stream ends.
    body = {"messages": [{"role": "user", "content": "stream it"}], "max_tokens": 3}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        text, finished = "", 0
        for line in r.iter_lines():
            for choice in json.loads(line[6:])["choices"] if line.startswith("data: {") else ():
                if choice["finish_reason"] is not None:
                    streamed = answered_key(body["messages"], text)
                    assert httpx.get(url + str(streamed), headers=shown).status_code == 200
                    finished += 1
                text += choice["delta"].get("content", "")
    assert text and finished == 1
    # A malformed request records nothing.
    bad = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "robot"}]})
    assert bad.status_code == 400
    assert (
        httpx.get(url + str(conversation_key([{"role": "robot"}])), headers=shown).status_code
        == 404
    )
    # A tenant's chats are its own: not recorded for the picker, which keys only the
    # public tenant's.
    tenanted = live_server(internal_token="picker-1", api_keys_file=key_file)
    assert chat(tenanted, "hello there", "sk-alpha-1").status_code == 200
    assert (
        httpx.get(tenanted.url + "/dscache/conversations/" + key, headers=shown).status_code == 404
    )
