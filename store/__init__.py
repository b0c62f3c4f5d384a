"""The per-node store: owns the node's shared-memory DRAM pool, serves its control API."""
