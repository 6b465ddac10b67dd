"""The router's rendered nginx.conf: its text, and real NGINX running it on loopback.

The second half starts Debian's NGINX (with the Lua module) in front of small
HTTP upstreams in this process and checks what a user of the router would
notice: stickiness, the cookie, the canary split as the weight grows, and
prompt-keyed routing of requests that carry no session id.
"""

from __future__ import annotations

import json

import pytest
from dscache_router.nginx import PromptKey, RouterConfig, render_nginx_conf
from pydantic import ValidationError
from router_helpers import Nginx, Pod

# --------------------------------------------------------------------------- text


def test_render_is_deterministic_and_hashes_the_session_key() -> None:
    cfg = RouterConfig(
        stable=("10.0.0.1:8000", "10.0.0.2:8000"), canary=("10.0.1.1:8000",), balance_factor=0
    )
    text = render_nginx_conf(cfg)
    assert text == render_nginx_conf(cfg.model_copy())
    assert text.count("hash $dscache_key consistent;") == 2
    assert "balancer_by_lua_block" not in text  # factor 0: NGINX's own consistent hash
    assert "server 10.0.0.1:8000 " in text and "server 10.0.1.1:8000 " in text
    # Only a client's own id goes upstream as the session; the route key always does.
    assert "proxy_set_header X-Session-ID $dscache_session_id;" in text
    assert "proxy_set_header X-Dscache-Route-Key $dscache_key;" in text
    assert "map $http_x_session_id $dscache_client_key" in text
    assert '"" $cookie_dscache_session;' in text


def test_bounded_loads_render_a_lua_balancer_per_track() -> None:
    cfg = RouterConfig(stable=("10.0.0.1:8000", "[fd00::2]:8000"), canary=("10.0.1.1:8000",))
    assert cfg.balance_factor == 1.25  # on by default
    text = render_nginx_conf(cfg)
    assert text == render_nginx_conf(cfg.model_copy())
    assert "hash $dscache_key consistent;" not in text
    assert text.count("balancer_by_lua_block") == 2
    assert 'require("dscache_router").balance("dscache_stable")' in text
    assert '["dscache_stable"] = {"10.0.0.1:8000", "[fd00::2]:8000"}' in text
    assert "factor = 1.25," in text and "keepalive 32;" in text
    assert "factor = 2.0," in render_nginx_conf(cfg.model_copy(update={"balance_factor": 2}))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"stable": ("pod-a:8000",)}, "resolves no names"),
        ({"stable": ("10.0.0.1:8000",), "balance_factor": 0.5}, "or at least 1"),
        ({"stable": ("10.0.0.1:8000",), "balance_factor": -1}, "greater than or equal"),
        ({"upstream_header": "X-Dscache-Tenant"}, "reserved"),
        ({"picker": "127.0.0.1:8090", "balance_factor": 0}, "picker needs the Lua balancer"),
        ({"picker": "127.0.0.1:8090; deny all"}, "upstream address"),
    ],
)
def test_bad_balancer_inputs_are_rejected_with_a_reason(
    bad: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        RouterConfig.model_validate(bad)


def test_client_tenant_headers_are_always_dropped() -> None:
    for cfg in (RouterConfig(stable=("10.0.0.1:8000",)), RouterConfig(canary=("10.0.0.1:8000",))):
        text = render_nginx_conf(cfg)
        assert 'proxy_set_header X-Dscache-Tenant "";' in text
        assert 'proxy_set_header X-Dscache-Gateway-Token "";' in text


def test_header_and_cookie_names_are_configurable() -> None:
    cfg = RouterConfig(stable=("10.0.0.1:1",), session_header="X-Conversation", cookie_name="conv")
    text = render_nginx_conf(cfg)
    assert "map $http_x_conversation $dscache_client_key" in text
    assert '"" $cookie_conv;' in text
    assert 'default "conv=$dscache_key; Path=/;' in text


@pytest.mark.parametrize(
    ("stable", "canary", "weight", "expected"),
    [
        (("10.0.0.1:1",), ("10.0.0.2:1",), 10, "10% canary;"),
        (("10.0.0.1:1",), ("10.0.0.2:1",), 12.5, "12.5% canary;"),
        (("10.0.0.1:1",), ("10.0.0.2:1",), 0, "default stable;"),
        (("10.0.0.1:1",), ("10.0.0.2:1",), 100, "default canary;"),
        (("10.0.0.1:1",), (), 50, "default stable;"),  # no canary pods: everything stable
        ((), ("10.0.0.2:1",), 10, "default canary;"),  # no stable pods: everything canary
    ],
)
def test_track_split(
    stable: tuple[str, ...], canary: tuple[str, ...], weight: float, expected: str
) -> None:
    text = render_nginx_conf(RouterConfig(stable=stable, canary=canary, canary_weight=weight))
    assert expected in text
    assert ("upstream dscache_canary" in text) == bool(canary)
    assert ("upstream dscache_stable" in text) == bool(stable)


def test_config_watch_is_an_option_and_its_id_names_the_config() -> None:
    base = RouterConfig(stable=("10.0.0.1:1",), canary=("10.0.0.2:1",), canary_weight=10)
    assert "init_worker_by_lua_block" not in render_nginx_conf(base)  # off by default
    assert "dscache-config-id" not in render_nginx_conf(base)
    watched = base.model_copy(update={"watch_config": True, "config_path": "/etc/r/nginx.conf"})
    text = render_nginx_conf(watched)
    header, id_line = text.splitlines()[:2]
    assert header.startswith("# Rendered by dscache_operator.nginx")  # unchanged by the move
    config_id = id_line.removeprefix("# dscache-config-id: ")
    assert len(config_id) == 16 and int(config_id, 16) >= 0
    # The running config knows its own id and where to look; worker 0 alone watches.
    assert f'"/etc/r/nginx.conf", "{config_id}"' in text
    assert "ngx.worker.id() ~= 0" in text and "ngx.timer.every(1, check)" in text
    assert "ffi.C.kill(ffi.C.getppid(), 1)" in text
    # Same config, same id; any change (weight, path, interval), another id.
    assert render_nginx_conf(watched.model_copy()) == text
    others = [
        watched.model_copy(update={"canary_weight": 25}),
        watched.model_copy(update={"config_path": "/etc/other.conf"}),
        watched.model_copy(update={"watch_interval_s": 2.0}),
    ]
    ids = {render_nginx_conf(c).splitlines()[1] for c in [watched, *others]}
    assert len(ids) == 4
    # Without the watcher the rest of the text is the same.
    assert text.replace(text[text.index("    init_worker") : text.index("    access_log")], "") == (
        render_nginx_conf(base).replace(header + "\n", header + "\n" + id_line + "\n")
    )


def test_no_upstreams_answers_503() -> None:
    text = render_nginx_conf(RouterConfig())
    assert "return 503" in text and "proxy_pass" not in text


def test_prompt_key_is_an_option() -> None:
    pods = ("10.0.0.1:1",)
    on = render_nginx_conf(RouterConfig(stable=pods, prompt_key=PromptKey(max_bytes=512)))
    off = render_nginx_conf(RouterConfig(stable=pods, prompt_key=PromptKey(mode="off")))
    assert "access_by_lua_block" in on and "local max_bytes, max_messages = 512, 2" in on
    assert "access_by_lua_block" not in off
    # Everything Lua off: a config any NGINX runs, no Lua module needed.
    bare = RouterConfig(
        stable=pods, prompt_key=PromptKey(mode="off"), balance_factor=0, metrics=False
    )
    assert not bare.uses_lua and "lua" not in render_nginx_conf(bare)


@pytest.mark.parametrize(
    "bad",
    [
        {"stable": ("10.0.0.1:80; return 200",)},
        {"stable": ("10.0.0.1",)},
        {"session_header": "X-Id; evil"},
        {"cookie_name": "my-cookie"},
        {"temp_dir": "/tmp; include /etc/passwd"},
        {"listen": "0.0.0.0:80 default_server"},
        {"canary_weight": 101},
        {"stable": ("10.0.0.1:1",), "canary": ("10.0.0.1:1",)},
        {"stable": ('10.0.0.1:1"',)},
    ],
)
def test_values_that_could_inject_directives_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        RouterConfig.model_validate(bad)


# --------------------------------------------------------------------------- real NGINX


def _tracks(pods: dict[str, Pod]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    stable = tuple(pods[n].address for n in ("s0", "s1", "s2"))
    canary = tuple(pods[n].address for n in ("c0", "c1"))
    return stable, canary


def test_nginx_accepts_every_rendering(nginx: Nginx, pods: dict[str, Pod]) -> None:
    stable, canary = _tracks(pods)
    for kwargs in (
        {"stable": stable, "canary": canary, "canary_weight": 37.5},
        {"stable": stable, "canary_weight": 0},
        {"canary": canary},
        {},
        {"stable": stable, "prompt_key": PromptKey(mode="off")},
        {"stable": stable, "canary": canary, "balance_factor": 0, "metrics": False},
        {"stable": stable, "balance_factor": 3, "session_memory_s": 60, "previous": canary},
        {"stable": stable, "canary": canary, "session_memory_s": 60, "picker": "127.0.0.1:9"},
        {"stable": stable, "picker": "127.0.0.1:9", "prompt_key": PromptKey(mode="off")},
    ):
        result = nginx.check(nginx.config(**kwargs))
        assert result.returncode == 0, result.stderr


def test_sessions_stick_and_new_ones_get_a_cookie(nginx: Nginx, pods: dict[str, Pod]) -> None:
    stable, canary = _tracks(pods)
    nginx.start(nginx.config(stable=stable, canary=canary, canary_weight=30))
    for i in range(20):
        sid = f"session-{i}"
        first = nginx.get("/v1/models", {"X-Session-ID": sid})[1]
        assert first["x-sid"] == sid and "set-cookie" not in first
        for _ in range(3):
            again = nginx.get("/v1/models", {"X-Session-ID": sid})[1]
            assert again["x-pod"] == first["x-pod"]
        # The same key as a cookie reaches the same pod.
        by_cookie = nginx.get("/v1/models", {"Cookie": f"dscache_session={sid}"})[1]
        assert by_cookie["x-pod"] == first["x-pod"]
        assert by_cookie["x-dscache-key-source"] == "cookie"

    # No id at all: routed by a fresh key, which the client gets as a cookie but the
    # model server never sees as a session; the cookie makes the next turn a session.
    status, fresh = nginx.get("/v1/models")
    assert status == 200 and fresh["x-dscache-key-source"] == "new"
    cookie = fresh["set-cookie"].split(";", 1)[0]
    name, value = cookie.split("=", 1)
    assert name == "dscache_session" and value == fresh["x-route"]
    assert fresh["x-sid"] == ""
    follow = nginx.get("/v1/models", {"Cookie": cookie})[1]
    assert follow["x-pod"] == fresh["x-pod"] and follow["x-sid"] == value


def test_canary_sessions_stay_on_the_canary_as_the_weight_grows(
    nginx: Nginx, pods: dict[str, Pod]
) -> None:
    stable, canary = _tracks(pods)
    sids = [f"user-{i}" for i in range(300)]
    seen: dict[float, dict[str, str]] = {}
    for weight in (10, 25, 50, 100):
        nginx.start(nginx.config(stable=stable, canary=canary, canary_weight=weight))
        seen[weight] = {
            s: nginx.get("/v1/models", {"X-Session-ID": s})[1]["x-dscache-track"] for s in sids
        }
    nginx.stop()
    shares = {w: sum(t == "canary" for t in m.values()) / len(sids) for w, m in seen.items()}
    assert 0.04 < shares[10] < 0.18 and 0.40 < shares[50] < 0.60 and shares[100] == 1.0
    for low, high in ((10, 25), (25, 50), (50, 100)):
        moved_back = [s for s in sids if seen[low][s] == "canary" and seen[high][s] != "canary"]
        assert moved_back == []


def _chat(system: str, turns: list[str]) -> bytes:
    messages = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        messages.append({"role": "user", "content": t})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": f"answer {i}"})
    return json.dumps({"model": "m", "messages": messages, "stream": False}).encode()


def test_requests_without_any_id_are_routed_by_their_prompt(
    nginx: Nginx, pods: dict[str, Pod]
) -> None:
    stable, _ = _tracks(pods)
    nginx.start(nginx.config(stable=stable))
    headers = {"Content-Type": "application/json"}
    conversations = [
        (f"You are an analyst. Company {c}: " + "balance sheet " * 50, [f"q{c}"]) for c in range(12)
    ]
    pods_of: dict[int, set[str]] = {}
    keys: dict[int, set[str]] = {}
    for c, (system, first) in enumerate(conversations):
        turns = list(first)
        for k in range(4):  # the conversation grows; the id is never sent
            turns.append(f"follow-up {k}")
            out = nginx.request("POST", "/v1/chat/completions", _chat(system, turns), headers)[1]
            assert out["x-dscache-key-source"] == "prompt"
            # A prompt key routes; it is neither a session upstream nor a cookie.
            assert out["x-sid"] == "" and "set-cookie" not in out
            assert out["x-route"].startswith("p-")
            pods_of.setdefault(c, set()).add(out["x-pod"])
            keys.setdefault(c, set()).add(out["x-route"])
    assert all(len(p) == 1 for p in pods_of.values()), pods_of
    assert all(len(k) == 1 for k in keys.values()), keys
    assert len({next(iter(k)) for k in keys.values()}) == len(conversations)
    assert len({next(iter(p)) for p in pods_of.values()}) > 1  # spread over the pods

    # Without the Lua option every id-less request is a new session.
    nginx.start(nginx.config(stable=stable, prompt_key=PromptKey(mode="off")))
    system, first = conversations[0]
    srcs = {
        nginx.request("POST", "/v1/chat/completions", _chat(system, first), headers)[1]["x-route"]
        for _ in range(3)
    }
    assert len(srcs) == 3
