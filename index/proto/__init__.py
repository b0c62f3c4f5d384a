"""Generated protobuf/gRPC modules of the index API (scripts/gen_protos.sh)."""
