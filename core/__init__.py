"""The vocabulary every kvtier package shares: chunk keys (``keys``), tiers and chunk
facts (``chunks``), error codes (``errors``), the one config model (``config``), who may call
what (``auth``), and the gRPC / HTTP plumbing of every service (``rpc``, ``http``).

May import: nothing else of kvtier. Everything else may import it.
"""
