"""The demos: the whole data path driven by the finance workload.

The local demo (``dscache demo``): :mod:`.procs` starts and stops child
processes, :mod:`.parts` describes and configures each one, :mod:`.stack`
starts real sidecars, model servers, NGINX and Prometheus on loopback, and
:mod:`.run` replays the workload with the cache off and on; :mod:`.run_report`
turns that into the table, the targets and the figure.

The Kubernetes demo (``dscache demo kubernetes``) is the :mod:`.kube` package.
Both print and write their reports through :mod:`.output`.

Nothing here is imported by ``dscache --help``; the CLI loads it on demand.
"""
