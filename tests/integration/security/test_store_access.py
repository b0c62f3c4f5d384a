"""The store as an attacker on the network meets it: no credential, a wrong one, a role that
does not allow the call, another tenant's. Every refused call must change nothing."""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request

import grpc
import pytest

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import salt_digest
from kvtier.core.rpc import ClientAuth, open_channel
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.store.proto import store_pb2 as pb
from kvtier.store.proto import store_pb2_grpc
from kvtier.store.server.grpc import STORE_PERMISSIONS
from kvtier.tiers.cpu import CpuTier

from support.secure_env import SALTS, TOKENS, SecureStore
from support.secure_store import CHUNK, client, namespace, put_chunks


def admin_stats(store: SecureStore) -> dict:
    c = client(store, TOKENS["admin"])
    try:
        return c.stats()
    finally:
        c.close()


def raw_call(store: SecureStore, method: str, token: str | None) -> grpc.StatusCode:
    """Call ``method`` with an empty request: the status tells whether auth let it through."""
    channel = open_channel(store.address, ClientAuth(token))
    stub = store_pb2_grpc.StoreStub(channel)
    request_type = pb.DESCRIPTOR.services_by_name["Store"].methods_by_name[method].input_type
    request = getattr(pb, request_type.name)()
    try:
        getattr(stub, method)(request, timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined]
    finally:
        channel.close()


STORE_METHODS = list(pb.DESCRIPTOR.services_by_name["Store"].methods_by_name)
# open to every caller (``Prove``: a store proves its credential before callers send theirs)
PUBLIC = {name for name, p in STORE_PERMISSIONS.items() if p.value == "public"}


def test_every_rpc_has_a_permission() -> None:
    """A new RPC is refused to everyone until someone decides who may call it."""
    assert set(STORE_METHODS) <= set(STORE_PERMISSIONS)


@pytest.mark.parametrize("token", [None, "not-a-token-at-all-000"])
def test_no_or_wrong_credential_is_refused_and_changes_nothing(
    secure_store: SecureStore, token: str | None
) -> None:
    put_chunks(secure_store, TOKENS["engine-all"], "a")
    before = admin_stats(secure_store)
    for method in STORE_METHODS:
        code = raw_call(secure_store, method, token)
        if method in PUBLIC:  # answered (an empty nonce is a bad argument), nothing changed
            assert code is grpc.StatusCode.INVALID_ARGUMENT, method
        else:
            assert code is grpc.StatusCode.UNAUTHENTICATED, method
    after = admin_stats(secure_store)
    assert after["chunks"] == before["chunks"] and after["chunks"] > 0


def _granted(*permissions: str) -> set[str]:
    return {name for name, p in STORE_PERMISSIONS.items() if p.value in permissions}


@pytest.mark.parametrize(
    ("role", "allowed"),
    [
        ("reader", set()),
        ("index", {"Info", "Stats", "Snapshot", "ReadEvents"}),
        ("engine-all", _granted("store.info", "store.data")),
        ("node", _granted("store.info", "store.data", "store.peer")),
    ],
)
def test_each_role_reaches_only_its_calls(
    secure_store: SecureStore, role: str, allowed: set[str]
) -> None:
    for method in STORE_METHODS:
        code = raw_call(secure_store, method, TOKENS[role])
        if method in allowed | PUBLIC:
            assert code is not grpc.StatusCode.PERMISSION_DENIED, (role, method)
            assert code is not grpc.StatusCode.UNAUTHENTICATED, (role, method)
        else:
            assert code is grpc.StatusCode.PERMISSION_DENIED, (role, method)


def test_clear_needs_an_admin(secure_store: SecureStore) -> None:
    put_chunks(secure_store, TOKENS["engine-all"], "b")
    engine = client(secure_store, TOKENS["engine-all"])
    with pytest.raises(KvtierError) as err:
        engine.clear()
    assert err.value.code is ErrorCode.PERMISSION_DENIED
    engine.close()
    assert admin_stats(secure_store)["chunks"] > 0


def test_a_tenant_cannot_read_probe_delete_or_poison_another(secure_store: SecureStore) -> None:
    ns_a, keys_a = put_chunks(secure_store, TOKENS["engine-a"], "a")
    b = client(secure_store, TOKENS["engine-b"])
    try:
        # register the victim's namespace (to then read or plant chunks in it): refused
        with pytest.raises(KvtierError) as err:
            b.register_namespace(namespace("a"), CHUNK)
        assert err.value.code is ErrorCode.PERMISSION_DENIED
        # probe: the victim's namespace answers exactly like one that does not exist
        unknown = namespace(None).model_copy(update={"model": "other"}).root_key()
        for ns_id in (ns_a, unknown):
            with pytest.raises(KvtierError) as err:
                b.lookup(ns_id, keys_a)
            assert err.value.code is ErrorCode.UNKNOWN_NAMESPACE
            assert "not registered" in err.value.message
        for call in (
            lambda: b.delete(ns_a, keys_a),
            lambda: b.allocate(ns_a, keys_a, [CHUNK] * len(keys_a)),  # poisoning
            lambda: b.fetch(ns_a, keys_a, "elsewhere:1", 1.0),
        ):
            with pytest.raises(KvtierError) as err:
                call()
            assert err.value.code is ErrorCode.UNKNOWN_NAMESPACE
        # enumeration: snapshot and events reveal every namespace; an engine gets neither
        for call in (b.snapshot, lambda: b.read_events(1, 16, None)):
            with pytest.raises(KvtierError) as err:
                call()
            assert err.value.code is ErrorCode.PERMISSION_DENIED
    finally:
        b.close()
    # the victim's chunks are intact and its own engine still reads them
    with CpuTier(client(secure_store, TOKENS["engine-a"])) as tier:
        ns_id = tier.register_namespace(namespace("a"), CHUNK)
        got = tier.get(ns_id, keys_a)
    assert [bytes(g[:1]) for g in got] == [bytes([i]) for i in range(len(keys_a))]


def test_unix_socket_serves_the_node_without_a_token(secure_store: SecureStore) -> None:
    socket = secure_store.socket
    assert socket.stat().st_mode & 0o777 == 0o600
    assert socket.parent.stat().st_mode & 0o777 == 0o700
    local = GrpcStoreClient(f"unix:{socket}", timeout_s=5)
    try:
        assert local.info().node_id == "secure-node"
        assert local.stats()["chunks"] >= 0  # the node's own: the local admin
    finally:
        local.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_unix_socket_refuses_another_uid(secure_store: SecureStore) -> None:
    """The kernel's check: a process of another uid cannot even connect to the socket."""
    nobody = 65534
    pid = os.fork()
    if pid == 0:  # child: become nobody, try to connect (a raw socket: no gRPC after fork)
        code = 3
        try:
            os.setgid(nobody)
            os.setuid(nobody)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(secure_store.socket))
            code = 0  # connected: the boundary failed
        except PermissionError:
            code = 13
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 13
    # and the store's own uid does connect
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(secure_store.socket))


def _get(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_http_stats_needs_an_observer_probes_stay_open(secure_store: SecureStore) -> None:
    http = secure_store.service.http
    assert _get(f"{http}/healthz") == 200
    assert _get(f"{http}/readyz") == 200
    assert _get(f"{http}/metrics") == 200
    assert _get(f"{http}/stats") == 401
    assert _get(f"{http}/stats", "wrong-token-0000000000") == 401
    assert _get(f"{http}/stats", TOKENS["engine-a"]) == 403
    assert _get(f"{http}/stats", TOKENS["index"]) == 200


def test_salts_never_reach_metrics_or_stats(secure_store: SecureStore) -> None:
    put_chunks(secure_store, TOKENS["engine-a"], "a")
    with urllib.request.urlopen(f"{secure_store.service.http}/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    stats = json.dumps(admin_stats(secure_store))
    for salt in SALTS.values():
        for text in (metrics, stats):
            assert salt not in text and salt_digest(salt) not in text
