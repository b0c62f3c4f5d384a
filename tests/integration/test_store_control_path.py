"""The engine's hot path to a node store process: the control socket (framed protobuf on a
Unix socket, ``kvtier.store.server.control``) answers exactly what gRPC answers, misses are
answered from the store's shared view without a call, and a store killed and restarted under
a client that reads the view is followed, never taken for an empty one."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.chunks import LookupStatus
from kvtier.core.config import StoreConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api.types import AllocateCall, CommitCall, LeaseStatus
from kvtier.store.client import view_leases, wire
from kvtier.store.client.control import ControlChannel
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.store.proto import store_pb2 as pb
from kvtier.testing.ports import free_port
from kvtier.testing.services import start_store, store_stats
from kvtier.tiers import connect

CHUNK = 4096
NS = Namespace(
    model="ctl", dtype="uint8", num_layers=1, num_kv_heads=1, head_size=CHUNK, chunk_tokens=16
)


def keys_of(first_token: int, n: int) -> list[bytes]:
    return prompt_keys(NS, np.arange(first_token, first_token + n * 16, dtype=np.uint32))


def test_the_control_socket_answers_as_grpc_does(run_dir: Path) -> None:
    store = start_store(run_dir, "16MiB", "ctl", remote=False)
    fast = GrpcStoreClient(store.address)
    slow = GrpcStoreClient(store.address, fast_control=False)
    try:
        info = fast.info()
        assert fast.control is not None and slow.control is None
        mode = os.stat(info.control_socket).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        ns_id = fast.register_namespace(NS, CHUNK)
        assert slow.register_namespace(NS, CHUNK) == ns_id
        for client, first in ((fast, 0), (slow, 10_000)):
            keys = keys_of(first, 4)
            written = client.allocate(ns_id, keys, [CHUNK] * 4)
            assert written.lease_id and client.commit(written.lease_id, None, [0] * 4) == 4
        # each reads what the other wrote, leased, the same way
        for client in (fast, slow):
            for first in (0, 10_000):
                got = client.lookup(ns_id, keys_of(first, 6), 30.0)
                assert (got.stop, len(got.hits)) == (LookupStatus.MISS, 4)
                assert client.release([got.lease_id]) == [LeaseStatus.OK]
        # errors: the same code and message on both paths
        for call in (
            lambda c: c.commit(999_999, None, []),
            lambda c: c.allocate(ns_id, keys_of(0, 2), [CHUNK - 1] * 2),
            lambda c: c.lookup(b"\1" * 16, keys_of(0, 2)),
        ):
            answers = []
            for client in (fast, slow):
                with pytest.raises(KvtierError) as err:
                    call(client)
                answers.append((err.value.code, err.value.message))
            assert answers[0] == answers[1], answers
        # a request of a previous incarnation is refused on the socket as over gRPC
        assert fast.control is not None
        with pytest.raises(KvtierError) as err:
            fast.control.call("Release", pb.ReleaseRequest(epoch=info.epoch ^ 1, lease_ids=[1]))
        assert err.value.code is ErrorCode.STALE_EPOCH

        # a step's calls in one message: each answered, an error in one leaves the others
        def lookup(first: int, n: int) -> pb.LookupRequest:
            return pb.LookupRequest(epoch=info.epoch, ns_id=ns_id, keys=b"".join(keys_of(first, n)))

        replies = fast.control.batch(
            [
                ("Lookup", lookup(0, 2)),
                ("Commit", pb.CommitRequest(epoch=info.epoch, lease_id=999_999)),
                ("Lookup", lookup(10_000, 3)),
            ]
        )
        answers = [r.code if isinstance(r, KvtierError) else r.hits for r in replies]
        assert answers[1] is ErrorCode.UNKNOWN_LEASE
        assert [len(wire.locations_from_pb(a)) for a in (answers[0], answers[2])] == [2, 3]
    finally:
        fast.close()
        slow.close()
        store.stop()


def test_a_miss_is_answered_from_the_view_without_a_call(run_dir: Path) -> None:
    store = start_store(run_dir, "16MiB", "view", remote=False)
    client = GrpcStoreClient(store.address)
    try:
        ns_id = client.register_namespace(NS, CHUNK)
        before = store_stats(store.address, store.pid)
        assert before is not None
        for first in range(0, 1600, 16 * 4):  # 25 misses
            got = client.lookup(ns_id, keys_of(first, 4), 30.0)
            assert (got.hits, got.lease_id) == ([], 0)
        assert client.view_misses == 25
        after = store_stats(store.address, store.pid)
        assert after is not None and after["lookups"] == before["lookups"]  # not one call
        # the view follows the store: stored, then hit (a call); deleted, then a miss again
        keys = keys_of(50_000, 3)
        written = client.allocate(ns_id, keys, [CHUNK] * 3)
        client.commit(written.lease_id, None, [0] * 3)
        got = client.lookup(ns_id, keys, 30.0)
        assert len(got.hits) == 3
        client.release([got.lease_id])
        assert client.delete(ns_id, keys[:1]) == 1
        misses = client.view_misses
        assert client.lookup(ns_id, keys).hits == []
        assert client.view_misses == misses + 1
    finally:
        client.close()
        store.stop()


def test_an_engines_first_hit_is_leased_without_a_call(run_dir: Path) -> None:
    """An engine's session gets its pin-table row as it opens, so not even the first hit of
    a fresh engine goes to the store."""
    store = start_store(run_dir, "16MiB", "first-hit", remote=False)
    writer, engine = GrpcStoreClient(store.address), GrpcStoreClient(store.address)
    try:
        ns_id = writer.register_namespace(NS, CHUNK)
        keys = keys_of(70_000, 3)
        written = writer.allocate(ns_id, keys, [CHUNK] * 3)
        writer.commit(written.lease_id, None, [0] * 3)
        assert engine.register_namespace(NS, CHUNK) == ns_id
        before = store_stats(store.address, store.pid)
        assert before is not None
        got = engine.lookup(ns_id, keys, 30.0)  # opens the engine's session: one call
        assert len(got.hits) == 3 and view_leases.owns(got.lease_id)
        after = store_stats(store.address, store.pid)
        assert after is not None and after["lookups"] == before["lookups"]
        assert engine.release([got.lease_id]) == [LeaseStatus.OK]
    finally:
        engine.close()
        writer.close()
        store.stop()


def test_a_store_killed_and_restarted_under_a_reading_client_is_followed(run_dir: Path) -> None:
    """SIGKILL: the store cannot retire its view, whose stale contents stay mapped. The client
    must not answer from it past the store's alive bound; once a new incarnation serves on
    the same address, the client re-attaches (its next calls say STALE_EPOCH), maps the new
    view and finds what was stored there."""
    port = free_port()
    env = {"KVTIER_STORE__SESSION_TIMEOUT_S": "1.0"}  # the view's alive bound: ~0.75 s
    first = start_store(run_dir, "16MiB", "restart", remote=False, env=env, grpc_port=port)
    tier = connect(StoreConfig(address=first.address))
    try:
        ns_id = tier.register_namespace(NS, CHUNK)
        old_socket = tier.info.control_socket
        assert tier.lookup(ns_id, keys_of(0, 2)).hits == []  # from the view
        tier.put(ns_id, keys_of(50_000, 2), [np.ones(CHUNK, np.uint8)] * 2)
        # leased by the engine itself (its allocation just now got its session a row)
        held = tier.lookup(ns_id, keys_of(50_000, 2), 30.0)
        assert len(held.hits) == 2 and view_leases.owns(held.lease_id)
        first.stop(signal.SIGKILL)
        time.sleep(1.0)  # past the alive bound
        assert not tier.known_miss(ns_id, keys_of(0, 2))  # no answer from a dead store's view
        second = start_store(run_dir, "16MiB", "restart", remote=False, env=env, grpc_port=port)
        try:
            with connect(StoreConfig(address=second.address)) as writer:
                ns2 = writer.register_namespace(NS, CHUNK)
                writer.put(ns2, keys_of(0, 2), [np.zeros(CHUNK, np.uint8)] * 2)
            deadline = time.monotonic() + 20
            while True:  # the old client: re-attaches on STALE_EPOCH, then hits
                try:
                    if len(tier.lookup(ns_id, keys_of(0, 2)).hits) == 2:
                        break
                except KvtierError as exc:
                    assert exc.code is ErrorCode.UNAVAILABLE, exc
                assert time.monotonic() < deadline, "the client never followed the restart"
                time.sleep(0.1)
            assert tier.info.control_socket != old_socket
            assert not Path(old_socket).exists()  # the crashed store's socket was removed
            # a lease of the dead incarnation is not taken for a good one (the new incarnation
            # never issued it); the new one's are
            assert tier.release([held.lease_id]) == [LeaseStatus.UNKNOWN]
            # the new session opens with its row: even the first hit is the engine's own
            again = tier.lookup(ns_id, keys_of(0, 2), 30.0)
            assert len(again.hits) == 2 and view_leases.owns(again.lease_id)
            assert tier.release([again.lease_id]) == [LeaseStatus.OK]
            assert tier.lookup(ns_id, keys_of(99_000, 2)).hits == []
            assert tier.known_miss(ns_id, keys_of(99_000, 2))  # the new view answers
        finally:
            second.stop()
    finally:
        tier.close()
        first.stop()  # already killed, unless the test failed before


def test_another_uid_cannot_use_the_control_socket(run_dir: Path) -> None:
    """0600 and the kernel's SO_PEERCRED: a process of another uid is refused (as root here,
    run the probe as nobody)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a probe as another uid")
    base = Path(tempfile.mkdtemp())
    base.chmod(0o711)  # nobody may reach the run dir's entries: only the socket's mode refuses
    run_dir = base / "run"
    run_dir.mkdir(mode=0o711)
    store = start_store(run_dir, "16MiB", "uid", remote=False)
    try:
        path = GrpcStoreClient(store.address, fast_control=False).info().control_socket
        probe = (
            "import os, socket, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            "    s.connect(sys.argv[1])\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
            "else:\n"
            "    print('connected')\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe, path], capture_output=True, text=True, timeout=30
        )
        assert out.stdout.startswith("refused"), out
        assert out.stdout.split()[1] == str(errno.EACCES), out
    finally:
        store.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_a_channel_refuses_a_socket_another_uid_serves() -> None:
    """The socket's path comes in the store's reply: the client hands its token only to a
    socket its own uid serves (SO_PEERCRED), so a path naming someone else's socket gets
    nothing."""
    if os.geteuid() != 0:
        pytest.skip("needs root to serve a socket as another uid")
    base = Path(tempfile.mkdtemp())
    base.chmod(0o777)  # nobody serves a socket here
    path = base / "other.sock"
    server = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); os.chmod(sys.argv[1], 0o777)\n"
        "s.listen(1); print('ready', flush=True)\n"
        "c, _ = s.accept(); data = c.recv(4096); print(repr(data), flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", server, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        channel = ControlChannel(str(path), "secret-token", timeout_s=2)
        request = pb.ReleaseRequest(epoch=1, lease_ids=[1])
        with pytest.raises(Exception, match="not served by uid"):
            channel.call("Release", request)
        proc.wait(5)
        assert "secret-token" not in proc.stdout.read()
    finally:
        proc.kill()
        shutil.rmtree(base, ignore_errors=True)


def test_placeholders_commit_under_their_names_on_both_paths(run_dir: Path) -> None:
    """Pool space taken under placeholder keys (an engine's save slab) commits under the
    chunks' names over the control socket and over gRPC alike, singly and in one batch, and
    never into another tenant's namespace."""
    store = start_store(run_dir, "16MiB", "held", remote=False)
    fast = GrpcStoreClient(store.address)
    slow = GrpcStoreClient(store.address, fast_control=False)
    try:
        assert fast.control is not None
        ns_id = fast.register_namespace(NS, CHUNK)
        other = fast.register_namespace(NS.model_copy(update={"cache_salt": "b"}), CHUNK)
        for client, first in ((fast, 0), (slow, 20_000)):
            held = [os.urandom(16) for _ in range(4)]
            lease = client.allocate(ns_id, held, [CHUNK] * 4).lease_id
            names = keys_of(first, 4)
            with pytest.raises(KvtierError) as err:  # another tenant's namespace: refused
                client.commit(lease, held[:1], [0], as_ns_id=other, as_keys=names[:1])
            assert err.value.code is ErrorCode.PERMISSION_DENIED
            assert client.commit(lease, held[:1], [0], as_ns_id=ns_id, as_keys=names[:1]) == 1
            batch = [
                CommitCall(lease, held[1:3], [0, 0], ns_id, names[1:3]),
                CommitCall(lease, held[3:], [0], ns_id, names[:1]),  # a name already stored
            ]
            assert client.commit_many(batch) == [2, 0]
            got = client.lookup(ns_id, names)
            assert (got.stop, len(got.hits)) == (LookupStatus.MISS, 3)
            assert client.lookup(other, names).stop is LookupStatus.MISS
        stats = store_stats(store.address, store.pid)
        assert stats is not None and stats["writing_bytes"] == 0 and stats["write_leases"] == 0
    finally:
        fast.close()
        slow.close()
        store.stop()


def test_the_store_counts_control_messages_and_the_calls_they_carry(run_dir: Path) -> None:
    """``control_messages`` / ``control_calls`` in the store's stats (and metrics): one per
    frame and one per call in it, so a step's batch shows as one message of several calls;
    gRPC calls and the connection's HELLO are not counted."""
    store = start_store(run_dir, "16MiB", "counted", remote=False)
    fast = GrpcStoreClient(store.address)
    slow = GrpcStoreClient(store.address, fast_control=False)

    def counts() -> tuple[int, int]:
        stats = store_stats(store.address, store.pid)
        assert stats is not None
        return int(stats["control_messages"]), int(stats["control_calls"])

    try:
        ns_id = fast.register_namespace(NS, CHUNK)
        before = counts()
        written = fast.allocate(ns_id, keys_of(0, 2), [CHUNK] * 2)  # one call
        assert counts() == (before[0] + 1, before[1] + 1)
        calls = [AllocateCall(ns_id, keys_of(100 * i, 2), [CHUNK] * 2) for i in (1, 2, 3)]
        got = fast.allocate_many(calls)  # one message of three calls
        assert counts() == (before[0] + 2, before[1] + 4)
        slow.commit(written.lease_id, None, [0, 0])  # over gRPC: not a control message
        assert counts() == (before[0] + 2, before[1] + 4)
        assert all(not isinstance(r, KvtierError) and r.lease_id for r in got)
    finally:
        fast.close()
        slow.close()
        store.stop()
