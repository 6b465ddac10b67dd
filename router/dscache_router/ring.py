"""Where the router sends a request, computed outside NGINX.

The router (NGINX, :mod:`dscache_router.nginx`) keys a request without a session
id by its prompt and places keys on a consistent-hash ring; the picker, the
endpoint picker and a prewarm that wants to warm the pod a prompt's requests will
reach must compute the same two things. This module is that computation, in
Python.

Contract (the router's Lua is the reference; a test runs both on real NGINX):
    * :func:`prompt_key` is the ``p-<md5 hex>`` key of a request body's bytes:
      the md5 of the raw JSON text of the ``"messages"`` array from its ``[``
      up to the end of its first ``max_messages`` top-level messages (or the
      array's end, or ``max_bytes`` bytes, whichever comes first); a body
      without ``"messages"`` hashes ``max_bytes`` bytes from ``"prompt"`` (or
      from its start). The key is of the bytes as sent: two clients that
      serialize the same chat differently get different keys.
    * :class:`Ring` is NGINX's ``hash ... consistent`` ring: 160 points a pod,
      point ``i`` = ``crc32(HOST "\\0" PORT le32(point i-1))`` starting from 0,
      sorted, duplicates dropped (the first pod keeps a shared point). A key's
      walk starts at the first point ``>= crc32(key)`` (past the last: the
      first) and lists each pod once, in the order the router's bounded-load
      balancer tries them. The ring depends on the set of pods, not on their
      order.
"""

from __future__ import annotations

import bisect
import hashlib
import zlib
from collections.abc import Iterable

#: Points a pod gets on the ring (NGINX's ``hash ... consistent``).
POINTS_PER_POD = 160


def _lead(body: bytes, max_bytes: int, max_messages: int) -> bytes:
    """The bytes of ``body`` the router's prompt key hashes."""
    start = body.find(b'"messages"')
    open_at = body.find(b"[", start) if start >= 0 else -1
    if open_at < 0:
        at = body.find(b'"prompt"')
        at = max(at, 0)
        return body[at : at + max_bytes]
    limit = min(len(body), open_at + max_bytes)
    depth, in_str, escaped, count = 0, False, False, 0
    for j in range(open_at + 1, limit):
        c = body[j]
        if in_str:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # quote
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x7B, 0x5B):  # { [
            depth += 1
        elif c in (0x7D, 0x5D):  # } ]
            if depth == 0:  # the array's own end
                return body[open_at:j]
            depth -= 1
            if depth == 0:
                count += 1
                if count >= max_messages:
                    return body[open_at : j + 1]
    return body[open_at:limit]


def prompt_key(body: bytes, *, max_bytes: int = 4096, max_messages: int = 2) -> str:
    """The router's key for ``body`` sent without a session id (``p-`` + md5 hex).

    Args:
        body: the request body, byte for byte as sent.
        max_bytes: the router's ``promptKey.maxBytes``.
        max_messages: the router's ``promptKey.maxMessages``.
    """
    lead = _lead(body, max_bytes, max_messages)
    return "p-" + hashlib.md5(lead, usedforsecurity=False).hexdigest()


class Ring:
    """A track's pods on NGINX's consistent-hash ring."""

    def __init__(self, pods: Iterable[str]) -> None:
        """Builds the ring of ``pods`` (``host:port`` each; IPv6 hosts in brackets).

        Raises:
            ValueError: no pod, or an address without a port.
        """
        self.pods = tuple(dict.fromkeys(pods))
        if not self.pods:
            raise ValueError("a ring needs at least one pod")
        points: list[tuple[int, int, str]] = []
        for index, pod in enumerate(self.pods):
            host, sep, port = pod.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"pod address {pod!r} is not host:port")
            base, prev = host.encode() + b"\0" + port.encode(), 0
            for _ in range(POINTS_PER_POD):
                prev = zlib.crc32(base + prev.to_bytes(4, "little"))
                points.append((prev, index, pod))
        points.sort(key=lambda p: (p[0], p[1]))  # a stable sort, as Lua's on distinct points
        self._hashes: list[int] = []
        self._owners: list[str] = []
        for h, _, pod in points:
            if not self._hashes or self._hashes[-1] != h:
                self._hashes.append(h)
                self._owners.append(pod)

    def walk(self, key: str) -> list[str]:
        """Every pod once, in the order the router tries them for ``key``."""
        at = bisect.bisect_left(self._hashes, zlib.crc32(key.encode()))
        n = len(self._hashes)
        order: list[str] = []
        for i in range(n):
            pod = self._owners[(at + i) % n]
            if pod not in order:
                order.append(pod)
                if len(order) == len(self.pods):
                    break
        return order
