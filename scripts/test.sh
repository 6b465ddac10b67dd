#!/usr/bin/env bash
# The test command: installs what is missing, then lint, types, architecture
# contracts, and the whole pytest suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh nginx-light libnginx-mod-http-ndk libnginx-mod-http-lua prometheus
source .venv/bin/activate

echo "== gRPC stubs"; bash scripts/check_proto.sh
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy (strict)"; mypy
echo "== import contracts"; lint-imports
echo "== pytest"
pytest -q -p no:cacheprovider "$@"
