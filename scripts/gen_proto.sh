#!/usr/bin/env bash
# Regenerates the Python gRPC stubs (and their type stubs) of dscache/v1/kvcache.proto.
set -euo pipefail
cd "$(dirname "$0")/.."
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m grpc_tools.protoc -I . \
  --python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. dscache/v1/kvcache.proto
