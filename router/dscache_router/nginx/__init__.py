"""The router's ``nginx.conf``: :class:`RouterConfig` in, text out (a pure function).

What is forwarded: only ``/v1/`` (the OpenAI API). Every other path gets the
router's own 404 (JSON), so a client never reaches a model pod's ``/metrics``,
``/dscache/*`` (holdings and template filters, key info, templates) or probes;
the router's own ``/dscache/router/{health,status,metrics}`` are answered by
NGINX. Bounds: requests in progress at once (``max_connections``, optionally
per client address; past it a JSON 503 with ``Retry-After``), the body size
(``max_body_bytes``, buffered in memory), and timeouts between reads of the
headers and of the body and between writes to the client.

Routing rules, in the order NGINX applies them to a request:

1. **Session key.** The ``session_header`` request header (default
   ``X-Session-ID``) if present and non-empty, else the ``cookie_name`` cookie,
   else a key derived from the prompt (when ``prompt_key`` is on and the body
   has one), else a fresh ``$request_id``. Whenever the key did not come from the
   client (prompt-derived or fresh), the response sets it as a cookie, so the
   client's next turn carries it. The key goes upstream as ``upstream_header``
   (default ``X-Session-ID``), which is what the model server reads.
2. **Track.** ``split_clients`` hashes the key (MurmurHash2) onto [0, 100%):
   the first ``canary_weight`` percent of that range goes to the canary track,
   the rest to stable. The canary range only ever grows from 0 as the weight is
   raised, so a session on the canary stays there at every larger weight, and a
   stable session moves at most once (stable -> canary). Weight 0 or 100 is a
   plain constant. A track with no upstreams sends everything to the other
   track; no upstreams at all answers 503.
3. **Pod.** ``hash $dscache_key consistent`` (ketama over CRC32) picks the pod
   within the track, so a conversation keeps hitting the pod that holds its KV
   blocks, and adding or removing one pod moves only about 1/N of the keys.
4. **Prompt key** (``prompt_key``, needs NGINX's Lua module): a request with
   neither header nor cookie is keyed by ``p-`` + MD5 of the leading part of its
   prompt: the first ``max_messages`` entries of ``"messages"`` (the system
   prompt and the first user turn), cut at ``max_bytes`` bytes; for
   ``/v1/completions`` the first ``max_bytes`` of ``"prompt"``. Every turn of a
   conversation, and every conversation opening with the same long document,
   shares that leading part, so id-less turns land on the pod holding it.

5. **Reload on change** (``watch_config``, needs the Lua module; the operator
   turns it on): NGINX runs as the container's only process, with no shell to
   watch its config. Worker 0 runs a timer (``watch_interval_s``) that reads
   the first bytes of ``config_path`` and compares the ``dscache-config-id``
   line there with the id of the config it is running (a literal in its own
   text); on a new id it sends the master SIGHUP through LuaJIT's FFI, once
   per id. The master re-reads the file and keeps serving the old config if
   the new one is invalid (and the worker does not signal again until the id
   changes once more). A ConfigMap volume swaps its ``..data`` symlink
   atomically, so the watcher never reads half a file. The id is a hash of
   everything but the watcher itself, so comparing ids is exact and race-free:
   a change between the master's read and the worker's start is still seen.

Invariants: the output depends only on the config (no clock, no randomness);
every string that reaches the file is validated against a strict pattern, so a
config value can never inject NGINX directives; upstream lists are rendered in
the order given (the consistent-hash ring does not depend on it).

Where: :mod:`.config` (the validated :class:`RouterConfig`), :mod:`.render`
(the text, from ``templates/nginx.conf.j2``), :mod:`.lua` (the Lua files in ``lua/``
it embeds).
"""

from __future__ import annotations

from dscache_router.nginx.config import DEBIAN_LUA_MODULES, PromptKey, RouterConfig
from dscache_router.nginx.render import CONFIG_ID_PREFIX, render_nginx_conf

__all__ = [
    "CONFIG_ID_PREFIX",
    "DEBIAN_LUA_MODULES",
    "PromptKey",
    "RouterConfig",
    "render_nginx_conf",
]
