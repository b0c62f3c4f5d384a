"""The per-node store: owns the node's shared-memory DRAM pool, serves its control API.

- ``api``: the control API one interface for an embedded store and a served one, and its types.
  May import: ``kvtier.core``.
- ``client``: the engine's and the admin's clients (gRPC, the mapped segment), importable without
  the server's dependencies. May import: ``store.api``, ``kvtier.core``.
- ``state``: the state machine (which chunks, which pages, leases, sessions, quotas, the event
  log). Pure Python under one lock; no I/O. May import: ``store.api``, ``store.pool``, core.
- ``pool``: the segment's page allocator, eviction policies and its watchdog.
- ``node``: ``NodeStore`` = segment + state machine, the object every front calls (in-process
  for an embedded store).
- ``remote``: the remote tier's store side (transfer engine, peers, fetch, demotion).
- ``server``: ``kvtier store serve``: gRPC and HTTP fronts, metrics, the process.
"""
