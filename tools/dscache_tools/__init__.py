"""dscache tooling: what a person runs beside the service, never the service itself.

The synthetic workload and load generator, the demos, the dev cluster, the trace
replay and the benchmarks. Tooling may import every runtime package; no runtime
package (``dscache``, ``dscache_sidecar``, ``dscache_server``,
``dscache_operator``) imports tooling, and an import-linter contract keeps it so.
"""
