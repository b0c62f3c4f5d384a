#!/usr/bin/env bash
# Regenerate the gRPC/protobuf modules from the .proto files (their output is committed so an
# install needs no code generation). A packaging test fails when they are out of date.
set -euo pipefail
cd "$(dirname "$0")/.."
gen() {  # $1 = folder holding <name>.proto, $2 = python package of that folder
  local dir=$1 pkg=$2 tmp
  tmp=$(mktemp -d)
  for proto in "$dir"/*.proto; do
    "${PYTHON:-python3}" -m grpc_tools.protoc -I "$dir" --python_out="$tmp" --pyi_out="$tmp" \
      --grpc_python_out="$tmp" "$proto"
  done
  # protoc writes absolute imports ("import store_pb2"); make them package-relative.
  sed -i -E "s/^import ([a-z_]+_pb2) as/from $pkg import \1 as/" "$tmp"/*_pb2_grpc.py
  cp "$tmp"/*.py "$tmp"/*.pyi "$dir"/
  rm -rf "$tmp"
}
gen store/proto kvtier.store.proto
gen index/proto kvtier.index.proto
