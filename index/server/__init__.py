"""``kvtier index serve`` and ``kvtier index ...``: gRPC (``grpc``) and HTTP (``http``) fronts,
who may see and write what (``access``), metrics, the process (``service``) and the CLI.

May import: the rest of ``kvtier.index``, ``kvtier.store.api`` / ``client``, ``kvtier.core``.
"""
