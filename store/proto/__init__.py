"""Generated protobuf/gRPC modules of the store API (scripts/gen_protos.sh)."""
