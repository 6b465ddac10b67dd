"""dscache's router: everything that decides which model pod answers a request.

It runs in the router pod (NGINX with its Lua, and ``dscache picker`` beside it,
from the slim core image) and in the operator (which renders the router's config).
One package, so the question "where does this request go" is answered here:

* :mod:`.nginx` — the router's ``nginx.conf`` from a validated ``RouterConfig``
  (``config.py``, ``render.py``, the template in ``templates/`` and the Lua in
  ``lua/``). The Lua remembers each session's track and pod (``session_memory.lua``,
  ``router.lua``'s pins); pure, the operator renders it.
* :mod:`.ring` — the prompt key and NGINX's consistent-hash ring in Python, for the
  picker, the endpoint picker and the prewarm Job (the Lua is the reference).
* :mod:`.picker` — the pod holding a request's longest cached prefix (sidecar
  filters, KV events via :mod:`.eventfeed`, its own recent placements, similarity;
  vLLM pods' GPU prefix caches from vLLM's own events, :mod:`.gputier`).
* :mod:`.locate` — which pod served a session last, asked of the pods (how several
  router replicas agree).
* :mod:`.serve` — ``dscache picker``'s HTTP face for NGINX; :mod:`.epp` — its
  Envoy ext_proc face (Gateway API Inference Extension endpoint picker);
  :mod:`.cli` — the command's flags.

The routing protocol the pods speak to the router (headers, paths, the session
ledger) is the core's :mod:`dscache.routing`; the picker keys requests with the
model server's tokenizer (:mod:`dscache_server.tokenizer`) and nothing else of the
server's (an import contract keeps it so).
"""

from __future__ import annotations

__all__: list[str] = []
