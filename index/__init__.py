"""The chunk index: which instance or node holds which chunk, in which tier.

- ``api``: ``ChunkIndex``, the one interface of every backend and client, and its types.
  May import: ``kvtier.store.api``, ``kvtier.core``.
- ``rules``: the checks, cursor rule and errors every implementation of ``api`` shares (the
  index's side: clients do not import it). May import: ``api``, ``kvtier.store.api``,
  ``kvtier.core``.
- ``client``: the gRPC client and the announcer, importable without the server.
- ``backends``: ``memory`` (embedded, and the reference) and ``redis`` (shared, durable).
- ``ingest``: followers of the sources that feed it (vLLM KV events, node stores' event
  streams) and the manager that runs them.
- ``server``: ``kvtier index serve``: gRPC and HTTP fronts, per-caller access rules, metrics,
  the process and its CLI.
"""
