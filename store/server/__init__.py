"""``kvtier store serve``: the process that owns a node's pool (``service``), its gRPC
(``grpc``) and HTTP (``http``) fronts, and its Prometheus metrics (``metrics``).

May import: the rest of ``kvtier.store``, ``kvtier.index.client`` (announcing), ``kvtier.core``.
Never imported by the vLLM process.
"""
