"""The router's Lua: real ``.lua`` files in ``lua/``, filled in and indented for nginx.conf.

Each file is plain Lua for NGINX's Lua module, checked by ``luacheck`` (its settings:
``lua/.luacheckrc``; ``scripts/test.sh`` runs it). What the renderer writes in is a
global read named ``DSCACHE_<NAME>`` (every one listed in ``.luacheckrc``):
:func:`fill` replaces each with the Lua literal given for it, and refuses a file
whose placeholders and values differ. A part that only some configs need sits
between the comment lines ``-- {<section>...`` and ``-- <section>}``: kept (without
those lines) when the section is on, dropped when it is off. Every value is built
from validated config fields (no quote, no backslash in them).

The files:

* ``prompt_key.lua`` (``access_by_lua``): keys a request that carries no session by
  the leading part of its prompt (``DSCACHE_SCAN``, ``DSCACHE_MAX_BYTES``,
  ``DSCACHE_MAX_MESSAGES``).
* ``session_memory.lua`` (``access_by_lua``): the track each session is on
  (``DSCACHE_LIVE``, ``DSCACHE_TTL``); sections ``picker``: a prompt-keyed request
  first takes the track of the pod holding its conversation past the opening, and a
  session this replica does not remember the track of the pod that served it
  (``dscache_router.locate``), so router replicas agree.
* ``watch.lua`` (``init_worker_by_lua``): reloads NGINX when the mounted config's id
  changes (``DSCACHE_PATH``, ``DSCACHE_ID``, ``DSCACHE_INTERVAL``).

``router.lua`` is the Lua module ``dscache_router`` (bounded-load balancer and request
counters): :mod:`.render` puts it in ``init_by_lua_block`` with ``DSCACHE_CONFIG`` a
Lua table literal built from the validated
:class:`~dscache_router.nginx.config.RouterConfig` (addresses, factor, metric
names); the module registers itself in ``package.loaded``, so each phase reaches it
with ``require("dscache_router")``.

State lives in the ``dscache_router`` shared dict, shared by the workers and
kept across reloads (counters stay monotonic): ``inflight:<pod>`` (tries in
progress), ``down:<pod>`` (failed within ``fail_timeout`` seconds; expires on
its own), and the counters ``requests:<track>:<class>``, ``retries:<track>``,
``tries:<pod>``, ``errors:<pod>``, ``skips:<pod>``.

A real session (a client's own id: its header or cookie) is pinned: the pod that
served it is remembered in the ``dscache_pins`` shared dict (``<upstream> \\0 <key>``,
``pin_ttl`` seconds after its last request) and takes its next requests whatever
its load, as long as it is up: that pod holds the session's KV, and moving the
session would recompute its whole history. Only new sessions, prompt-keyed
requests and retries are placed by the bounded walk below (and a session is pinned
where that walk put it). A prompt key is never pinned: the opening it stands for
is worth caching on several pods, and spreading it is the point.

``balance(upstream)`` (``balancer_by_lua``): the pods in NGINX's own
``hash ... consistent`` ring order from the key's point (160 points a pod,
``crc32(HOST \\0 PORT PREV_HASH)``, as ``ngx_http_upstream_hash_module`` builds
it, so with no load it picks exactly the pod NGINX would), skipping pods tried
by this request or down, and, with a factor, pods whose in-flight count is not
below ``ceil(factor * (in-flight of the track + 1) / live pods)``. No eligible
pod under the bound: the first eligible one; none eligible at all: the first
untried one (better a try than a certain 502). A retry marks the failed pod
down and ends its in-flight count; ``log()`` ends the last one (and marks its
pod down when it failed: no answer, 502, 503 or 504, as ``max_fails=1`` does).

``pick(upstream)`` (``access_by_lua``, with a picker configured): asks the
picker (:mod:`dscache_router.picker`) through the internal ``picker_path``
subrequest which pod holds the longest cached prefix of the request; the
balancer's first try takes that pod when it is in the track and up (the picker
applied the load bound from the in-flight counts it was sent). No answer within
the timeout, or a wrong one: the walk below, as without a picker.

Router replicas agree through the pods (:mod:`dscache_router.locate`). A
session (header or cookie) this replica has neither a track nor a pin for is
looked up once per request: ``locate(key)`` asks the picker, which asks every
live pod of every track whether it served the session, through the internal
``locate_path`` subrequest; the pod that did gives the session its track (the
session memory takes it) and its pin, so a session stays where its KV is
whichever replica it reaches, across weight changes, replica restarts and
scale-out. No answer in time, or no pod that knows it: placed as before.
What no ledger can answer goes by what the pods hold: a prompt-keyed request (its
key stands for an opening, the first ``lead_messages`` messages, that many
conversations share, so this replica's memory of the key says little about this
conversation) and a session no pod served (a client back under a new id) are
looked up through the internal ``holder_path`` subrequest (the body forwarded):
the picker names the pod holding the longest prefix of it when that prefix reaches
past the opening, the conversation's own history, which only the pods that served
it hold (:meth:`dscache_router.picker.Picker.holder`). That pod gives the request
its track and, on that track, its pod; an opening alone (a first turn, a shared
document every pod was prewarmed with) names none, so new conversations still
follow the weights.
``report()`` (``header_filter_by_lua``) keeps each pod's own in-flight count,
``X-Dscache-Inflight`` on its answers, for ``report_ttl`` seconds as
``reported:<pod>``; a pod's load is the larger of this replica's count and the
pod's report, so the bound sees what the other replicas sent.

``log()`` (``log_by_lua``, every proxied request) also counts the request by
track role and status class, its retries, and each try by pod from
``$upstream_addr`` / ``$upstream_status`` (so the counters work without the
balancer too; a pod label is only ever a configured address).
``metrics()`` serves them in Prometheus' text format.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_PLACEHOLDER = re.compile(r"\bDSCACHE_[A-Z_]+\b")


@cache
def read(name: str) -> str:
    """The text of ``lua/<name>`` (shipped inside the package)."""
    return resources.files(__package__).joinpath("lua", name).read_text(encoding="utf-8")


def fill(
    name: str, values: dict[str, str], *, indent: int, sections: dict[str, bool] | None = None
) -> str:
    """``lua/<name>`` with its placeholders replaced and its sections kept or dropped,
    every non-empty line indented by ``indent`` spaces; no trailing newline.

    Args:
        name: the file.
        values: the Lua literal for each placeholder, by name without ``DSCACHE_``.
        indent: spaces before each line (where the block sits in nginx.conf).
        sections: on or off, by section name; every section of the file must be named.

    Raises:
        ValueError: a placeholder without a value, a value without a placeholder, or
            a section not named.
    """
    sections = sections or {}
    kept: list[str] = []
    inside: str | None = None
    for line in read(name).rstrip("\n").split("\n"):
        opened = re.fullmatch(r"-- \{(\w+).*", line)
        if opened:
            inside = opened.group(1)
            if inside not in sections:
                raise ValueError(f"lua/{name}: section {inside!r} is not named")
            continue
        if inside is not None and line == f"-- {inside}}}":
            inside = None
            continue
        if inside is None or sections[inside]:
            kept.append(line)
    body = "\n".join(kept)
    found = {m.removeprefix("DSCACHE_") for m in _PLACEHOLDER.findall(body)}
    if found != set(values):
        raise ValueError(
            f"lua/{name}: placeholders {sorted(found)} but values for {sorted(values)}"
        )
    body = _PLACEHOLDER.sub(lambda m: values[m.group(0).removeprefix("DSCACHE_")], body)
    pad = " " * indent
    return "\n".join(pad + line if line else line for line in body.split("\n"))
