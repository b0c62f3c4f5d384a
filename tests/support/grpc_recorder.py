"""A gRPC server that answers every call with an empty reply and records each call's
metadata: the server at an address an attacker announced, to see what a client sends it."""

from __future__ import annotations

from concurrent import futures

import grpc


class GrpcRecorder(grpc.GenericRpcHandler):
    """A gRPC server that records every call's metadata: an address an attacker announced."""

    def __init__(self) -> None:
        self.metadata: list[tuple[str, str]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((self,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        self.metadata += list(details.invocation_metadata or ())

        def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
            return b""  # an empty reply parses as any message: an empty proof, an empty Info

        return grpc.unary_unary_rpc_method_handler(answer)
