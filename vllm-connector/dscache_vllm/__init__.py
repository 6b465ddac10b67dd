"""dscache for vLLM: a v1 KV connector that keeps vLLM's prefix KV in the node's dscache store.

``dscache_vllm.connector.DscacheConnector`` is what vLLM loads; ``plan`` (scheduler
side) and ``worker`` with ``paged`` (worker side) do the work; ``probe`` runs an
engine in a process of its own for tests and benchmarks; ``models`` builds local
random-weight checkpoints.
"""
