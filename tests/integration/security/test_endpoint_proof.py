"""A store proves it holds a node credential before anyone presents a token to it: the
challenge (``Prove``) is open, answers only the proof, and a server that cannot answer it
never sees the caller's token."""

from __future__ import annotations

import pytest

from kvtier.core.auth import Authenticator
from kvtier.core.config.auth import AuthConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.rpc import ClientAuth
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.store.client.proof import verify_store

from support.grpc_recorder import GrpcRecorder
from support.secure_env import TOKENS, SecureStore, credentials


def _verifier() -> Authenticator:
    return Authenticator(AuthConfig.model_validate({"credentials": credentials()}))


def test_a_node_store_proves_its_credential(secure_store: SecureStore) -> None:
    proved = verify_store(
        secure_store.address, ClientAuth(TOKENS["index"]), _verifier(), timeout_s=5
    )
    assert proved is not None and proved.name == "node"
    client = GrpcStoreClient(
        secure_store.address, 5, auth=ClientAuth(TOKENS["index"]), verify=_verifier()
    )
    assert client.proved is not None and client.info().node_id == "secure-node"
    client.close()


def test_a_verifier_that_does_not_know_the_node_refuses(secure_store: SecureStore) -> None:
    only_engines = Authenticator(
        AuthConfig.model_validate(
            {"credentials": [c for c in credentials() if c["role"] == "engine"]}
        )
    )
    with pytest.raises(KvtierError) as err:
        verify_store(secure_store.address, ClientAuth(TOKENS["index"]), only_engines, 5)
    assert err.value.code is ErrorCode.PERMISSION_DENIED


def test_an_endpoint_that_cannot_prove_never_sees_the_token() -> None:
    recorder = GrpcRecorder()
    try:
        with pytest.raises(KvtierError) as err:
            GrpcStoreClient(
                recorder.address, 2, auth=ClientAuth(TOKENS["index"]), verify=_verifier()
            )
        assert err.value.code is ErrorCode.PERMISSION_DENIED
        assert recorder.metadata, "the challenge reached the recorder"
        assert not any(TOKENS["index"] in value for _, value in recorder.metadata)
        # the control: without verification the same client hands the recorder its token
        GrpcStoreClient(recorder.address, 2, auth=ClientAuth(TOKENS["index"])).close()
        assert any(TOKENS["index"] in value for _, value in recorder.metadata)
    finally:
        recorder.server.stop(0)
