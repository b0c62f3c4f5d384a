"""An insider (one tenant's ``engine`` credential) against a store serving the remote tier:
``Fetch`` names the holder to pull from, and the store must dial only peers it knows (its
``store.remote.peers``, the node stores the index lists), proved by their node credential,
never an address the caller made up. Real processes on loopback, credentials on."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.keys import prompt_keys
from kvtier.core.rpc import ClientAuth
from kvtier.store.api.remote import FetchStatus
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.testing.ports import free_port
from kvtier.testing.services import Service, start_store
from kvtier.tiers.cpu import CpuTier

from support.grpc_recorder import GrpcRecorder
from support.helpers import start_index_process
from support.secure_env import TOKENS, auth_env
from support.secure_store import namespace

pytestmark = pytest.mark.remote

CHUNK = 64 << 10
N = 4
ENV = {"KVTIER_STORE__REMOTE__FETCH_TIMEOUT_S": "1.5"}


class _Listener:
    """A plain TCP port that counts the connections made to it (accepts, holds them open)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self._held:
            conn.close()


@dataclass
class Cluster:
    index: Service
    puller: Service  # the store the insider's engine uses
    peer: Service  # in the puller's store.remote.peers
    announced: Service  # known to the puller only through the index
    down_peer: str  # in the puller's peers, nothing listens there
    impostor: GrpcRecorder  # in the puller's peers, but no store: it cannot prove a credential


def _store(run_dir: Path, node: str, *extra: str) -> Service:
    env = {**auth_env(TOKENS["node"]), **ENV}
    return start_store(run_dir, "64MiB", node, remote=True, env=env, extra=extra)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("insider-fetch")
    index = start_index_process(env=auth_env(TOKENS["index"]))
    started: list[Service] = []
    impostor = GrpcRecorder()
    try:
        peer = _store(run_dir, "node-peer")
        started.append(peer)
        announced = _store(run_dir, "node-announced", "--index", index.address)
        started.append(announced)
        down_peer = f"127.0.0.1:{free_port()}"
        peers = f"{peer.address},{down_peer},{impostor.address}"
        puller = _store(run_dir, "node-puller", "--peers", peers, "--index", index.address)
        started.append(puller)
        yield Cluster(index, puller, peer, announced, down_peer, impostor)
    finally:
        for service in started:
            service.stop()
        index.stop()
        impostor.server.stop(0)


def _engine(store: Service, tenant: str = "a") -> GrpcStoreClient:
    return GrpcStoreClient(store.address, 5, auth=ClientAuth(TOKENS[f"engine-{tenant}"]))


def _chunks(seed: int) -> list[np.ndarray]:
    return [np.full(CHUNK, (seed + i) % 251, np.uint8) for i in range(N)]


def _put(store: Service, seed: int) -> tuple[bytes, list[bytes]]:
    ns = namespace("a")
    keys = prompt_keys(ns, np.arange(seed * 1000, seed * 1000 + N * ns.chunk_tokens))
    with CpuTier(_engine(store)) as tier:
        ns_id = tier.register_namespace(ns, CHUNK)
        tier.put(ns_id, keys, _chunks(seed))
    return ns_id, keys


def test_a_named_holder_is_never_dialed_and_never_gets_the_node_token(cluster: Cluster) -> None:
    """The attack: the puller connected to the engine's address and presented its node token
    there (with which the attacker then read and deleted other tenants' chunks)."""
    recorder, listener = GrpcRecorder(), _Listener()
    engine = _engine(cluster.puller)
    try:
        ns_id = engine.register_namespace(namespace("a"), CHUNK)
        keys = prompt_keys(namespace("a"), np.arange(N * 16))
        for target in (recorder.address, listener.address):
            result = engine.fetch(ns_id, keys, target, 2.0)
            assert not result.ok and result.local == 0, result
        time.sleep(0.5)  # a connection the store started would have arrived by now
        assert not any(TOKENS["node"] in value for _, value in recorder.metadata)
        assert recorder.metadata == [], "the store called the named address"
        assert listener.accepted == 0, "the store connected to the named address"
    finally:
        engine.close()
        recorder.server.stop(0)
        listener.close()


def test_a_listed_peer_that_cannot_prove_a_node_credential_never_gets_the_token(
    cluster: Cluster,
) -> None:
    """Even a peer from the configuration (or the index) is sent the node token only once it
    proved it holds a node credential: a listed address may have been taken over."""
    engine = _engine(cluster.puller)
    try:
        ns_id = engine.register_namespace(namespace("a"), CHUNK)
        keys = prompt_keys(namespace("a"), np.arange(N * 16))
        result = engine.fetch(ns_id, keys, cluster.impostor.address, 2.0)
        assert not any(TOKENS["node"] in value for _, value in cluster.impostor.metadata)
        assert cluster.impostor.metadata, "a listed peer is asked for its proof"
        assert result.status is FetchStatus.PEER_UNREACHABLE and result.local == 0, result
    finally:
        engine.close()


def test_open_closed_unknown_and_down_holders_answer_alike(cluster: Cluster) -> None:
    """No port oracle: whatever is (or is not) at an address the caller names, and a listed
    peer that is down, the answer is the same status and message."""
    recorder, listener = GrpcRecorder(), _Listener()
    closed = f"127.0.0.1:{free_port()}"
    engine = _engine(cluster.puller)
    try:
        ns_id = engine.register_namespace(namespace("a"), CHUNK)
        keys = prompt_keys(namespace("a"), np.arange(N * 16))
        answers = {}
        for name, target in {
            "closed port": closed,
            "open port (TCP)": listener.address,
            "open port (gRPC)": recorder.address,
            "no such host": "no-such-host.invalid:50551",
            "listed peer, down": cluster.down_peer,
            "listed peer, no proof": cluster.impostor.address,
        }.items():
            result = engine.fetch(ns_id, keys, target, 2.0)
            answers[name] = (result.status, result.message, result.local, result.holder_hits)
        assert len(set(answers.values())) == 1, answers
        status, message, _, _ = answers["closed port"]
        assert status is FetchStatus.PEER_UNREACHABLE and message
        for target in (closed, listener.address, recorder.address, cluster.down_peer):
            assert target.rsplit(":", 1)[1] not in message
    finally:
        engine.close()
        recorder.server.stop(0)
        listener.close()


def test_peers_from_the_config_and_from_the_index_still_serve(cluster: Cluster) -> None:
    for seed, holder in ((1, cluster.peer), (2, cluster.announced)):
        ns_id, keys = _put(holder, seed)
        engine = _engine(cluster.puller)
        try:
            engine.register_namespace(namespace("a"), CHUNK)
            deadline = time.monotonic() + 20  # the index learns of the announced store
            while True:
                result = engine.fetch(ns_id, keys, holder.address, 3.0)
                if result.ok or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert (result.status, result.local, result.fetched) == (FetchStatus.OK, N, N), (
                holder.ready["node_id"],
                result,
            )
        finally:
            engine.close()
        with CpuTier(_engine(cluster.puller)) as tier:
            got = tier.get(tier.register_namespace(namespace("a"), CHUNK), keys)
        assert [bytes(g) for g in got] == [c.tobytes() for c in _chunks(seed)]
