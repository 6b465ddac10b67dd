"""dscache: prefix KV-cache reuse for long-context LLM services.

This core package holds what every component shares: the cache-key contract
(``dscache.keys``), the gRPC protocol (``dscache.v1``) and the ``dscache``
command line (``dscache.cli``). Components live in their own import packages:
``dscache_sidecar`` (sidecar/), ``dscache_server`` (model-server/) and
``dscache_operator`` (operator/).
"""

__version__ = "0.1.0"
