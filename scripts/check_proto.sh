#!/usr/bin/env bash
# Fails when the committed gRPC stubs differ from what the .proto generates.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m grpc_tools.protoc -I . \
  --python_out="$tmp" --grpc_python_out="$tmp" --mypy_out="$tmp" --mypy_grpc_out="$tmp" \
  dscache/v1/kvcache.proto >/dev/null
for f in kvcache_pb2.py kvcache_pb2.pyi kvcache_pb2_grpc.py kvcache_pb2_grpc.pyi; do
  if ! diff -q "$tmp/dscache/v1/$f" "dscache/v1/$f" >/dev/null; then
    echo "dscache/v1/$f is stale: run scripts/gen_proto.sh" >&2
    exit 1
  fi
done
echo "gRPC stubs up to date"
