"""The session-aware router: NGINX configuration rendered from a small typed config.

One renderer serves both the local stack (``dscache demo``) and the Kubernetes
operator, so the routing rules a user tries on a laptop are the ones the cluster
runs. See :mod:`dscache.router.nginx` for the rules themselves.
"""

from __future__ import annotations

from dscache.router.nginx import (
    DEBIAN_LUA_MODULES,
    PromptKey,
    RouterConfig,
    render_nginx_conf,
)

__all__ = ["DEBIAN_LUA_MODULES", "PromptKey", "RouterConfig", "render_nginx_conf"]
