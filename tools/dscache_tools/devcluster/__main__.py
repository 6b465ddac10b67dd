"""``python -m dscache_tools.devcluster``: build or reuse the dev cluster's binaries.

Standard library and Go only, so CI can run it before the project's Python
dependencies are installed (``scripts/build-dev-cluster.sh`` does).
"""

from dscache_tools.devcluster.build import main

raise SystemExit(main())
