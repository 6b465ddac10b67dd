"""dscache sidecar: the node-local KV block store and its gRPC daemon.

Layers point one way: ``daemon`` -> ``store`` -> {``index``, ``segments``,
``codec``, ``eviction``}. Clients (the model server) use only ``client`` and the
generated ``dscache.v1`` stubs.
"""
