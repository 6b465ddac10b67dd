"""The local demo: the whole data path on one machine, driven by the finance workload.

``stack`` starts real sidecars, model servers, NGINX and Prometheus on loopback;
``run`` replays the workload with the cache off and on and reports the gain.
Nothing here is imported by ``dscache --help``; the CLI loads it on demand.
"""
