"""Microbenchmarks: one hot path each (keys, copies, the pool, the index, the router, the remote
tier), printed beside a floor measured in the same run."""
