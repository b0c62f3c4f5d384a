"""An insider (one tenant's ``engine`` credential) probing whether another tenant holds a
prompt. Namespace ids are no secret (the index lists them with every location), so an
engine can compute another namespace's chunk keys for a guessed prompt and ask for them
under its own namespace; and it can ask about another tenant's namespace directly. Both
must answer exactly like keys and namespaces that were never stored."""

from __future__ import annotations

import dataclasses
import inspect
import tracemalloc
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest

from kvtier.core.auth import Principal
from kvtier.core.chunks import LookupStatus
from kvtier.core.config import StoreConfig
from kvtier.core.config.auth import Role
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import prompt_keys
from kvtier.core.rpc import _CALLER
from kvtier.store.api.types import AllocStatus
from kvtier.store.node import NodeStore
from kvtier.store.proto import store_pb2 as pb
from kvtier.store.server.grpc import StoreServicer

from support.secure_env import TOKENS, SecureStore
from support.secure_store import CHUNK, client, namespace, put_chunks


def test_another_namespaces_keys_answer_like_absent_ones(secure_store: SecureStore) -> None:
    ns_a, victim = put_chunks(secure_store, TOKENS["engine-a"], "a", n=4)
    b = client(secure_store, TOKENS["engine-b"])
    try:
        assert b.control is not None  # these calls go on the store's control socket
        ns_b = b.register_namespace(namespace("b"), CHUNK)
        never = prompt_keys(namespace("b"), np.arange(10_000, 10_000 + 4 * 16))
        answers: dict[str, list[Any]] = {}
        for name, keys in (("victim's", victim), ("never stored", never)):
            answer: list[Any] = []
            for ttl in (None, 5.0):
                try:
                    got = b.lookup(ns_b, keys, ttl)
                    answer.append((got.stop, len(got.hits), bool(got.lease_id)))
                except KvtierError as exc:
                    answer.append((exc.code, exc.message))
            try:
                answer.append(b.delete(ns_b, keys[:2]))
            except KvtierError as exc:
                answer.append((exc.code, exc.message))
            answers[name] = answer
            for text in map(str, answer):
                assert ns_a.hex() not in text, text  # never names the victim's namespace
        assert answers["victim's"] == answers["never stored"], answers
        assert answers["never stored"][0] == (LookupStatus.MISS, 0, False)
        # Allocating the victim's keys under another namespace cannot take them over: the
        # least a refusal can say is "no room for this key" (docs/security.md).
        alloc = b.allocate(ns_b, victim[2:], [CHUNK] * 2)
        assert alloc.statuses == [AllocStatus.NO_SPACE] * 2 and not alloc.lease_id
    finally:
        b.close()
    # nothing of the victim's changed: all four chunks are there, byte for byte
    a = client(secure_store, TOKENS["engine-a"])
    try:
        assert a.register_namespace(namespace("a"), CHUNK) == ns_a
        got = a.lookup(ns_a, victim)
        assert (got.stop, len(got.hits)) == (LookupStatus.HIT, 4)
    finally:
        a.close()


def test_placeholders_cannot_take_another_tenants_names(secure_store: SecureStore) -> None:
    """Pool space an engine holds under placeholder keys commits under other names
    (``as_keys``) only within its own tenant: into another tenant's namespace it is told what
    a namespace never registered gets, and under a name another namespace holds it takes
    nothing over (the placeholder is freed, not counted), so the victim's chunks stay."""
    ns_a, victim = put_chunks(secure_store, TOKENS["engine-a"], "a", n=4)
    b = client(secure_store, TOKENS["engine-b"])
    try:
        assert b.control is not None
        ns_b = b.register_namespace(namespace("b"), CHUNK)
        held = [bytes([i]) * 16 for i in range(1, 4)]
        lease = b.allocate(ns_b, held, [CHUNK] * 3).lease_id
        answers = []
        for target in (ns_a, b"\7" * 16):  # the victim's namespace, one never registered
            with pytest.raises(KvtierError) as err:
                b.commit(lease, held[:1], [0], as_ns_id=target, as_keys=victim[:1])
            answers.append((err.value.code, err.value.message.replace(target.hex(), "<ns>")))
        assert answers[0] == answers[1] and answers[0][0] is ErrorCode.UNKNOWN_NAMESPACE
        assert b.commit(lease, held[:2], [0, 0], as_ns_id=ns_b, as_keys=victim[:2]) == 0
        assert b.lookup(ns_b, victim[:1]).stop is LookupStatus.MISS
        assert b.abort(lease) == 1
    finally:
        b.close()
    a = client(secure_store, TOKENS["engine-a"])
    try:
        assert a.register_namespace(namespace("a"), CHUNK) == ns_a
        got = a.lookup(ns_a, victim)
        assert (got.stop, len(got.hits)) == (LookupStatus.HIT, 4)
    finally:
        a.close()


def test_another_tenants_namespace_answers_byte_for_byte_like_none(
    secure_store: SecureStore,
) -> None:
    """Every call that names a namespace: the same code and message (the id the caller sent
    aside) for another tenant's namespace as for one never registered."""
    ns_a, keys = put_chunks(secure_store, TOKENS["engine-a"], "a", n=2)
    never = namespace(None).model_copy(update={"model": "never"}).root_key()
    b = client(secure_store, TOKENS["engine-b"])
    calls = {
        "lookup": lambda ns: b.lookup(ns, keys),
        "leased lookup": lambda ns: b.lookup(ns, keys, 5.0),
        "allocate": lambda ns: b.allocate(ns, keys, [CHUNK] * 2),
        "delete": lambda ns: b.delete(ns, keys),
        "fetch": lambda ns: b.fetch(ns, keys, "127.0.0.1:1", 1.0),
        "stage from disk": lambda ns: b.stage_from_disk(ns, keys, 1.0),
    }
    try:
        for name, call in calls.items():
            seen = []
            for ns in (ns_a, never):
                with pytest.raises(KvtierError) as err:
                    call(ns)
                seen.append((err.value.code, err.value.message.replace(ns.hex(), "<ns>")))
            assert seen[0] == seen[1], (name, seen)
            assert seen[0][0] is ErrorCode.UNKNOWN_NAMESPACE
    finally:
        b.close()


class _Aborted(Exception):
    pass


class _Context:
    """What a servicer method needs of a gRPC context when called in process."""

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.metadata = metadata

    def abort(self, code: Any, details: str) -> NoReturn:
        raise _Aborted(code, details)


def test_the_tenant_gate_remembers_nothing_the_store_forgot(tmp_path: Path) -> None:
    """The gate that tells tenants' namespaces apart must not grow with every namespace an
    engine ever tried to register: not with those the store refused (past
    ``max_namespaces``), nor keep those it retired."""
    config = StoreConfig(run_dir=tmp_path, pool={"capacity": 1 << 20}, max_namespaces=2)
    node = NodeStore(config)
    servicer = StoreServicer(node)
    salt = namespace("a").cache_salt
    token = _CALLER.set(Principal("engine-a", Role.ENGINE, frozenset({salt})))
    tracemalloc.start()
    try:

        def register(i: int) -> bytes:
            ns = namespace("a").model_copy(update={"model": f"m{i}"})
            request = pb.RegisterNamespaceRequest(
                epoch=servicer.epoch, namespace_json=ns.model_dump_json(), chunk_bytes=4096
            )
            try:
                return servicer.RegisterNamespace(request, _Context()).ns_id  # type: ignore[arg-type]
            except _Aborted:
                return b""

        kept = [register(i) for i in range(2)]  # the store's two namespaces
        assert all(kept)
        before = tracemalloc.take_snapshot()
        refused = [register(i) for i in range(2, 3000)]
        assert not any(refused)  # past max_namespaces, and none idle yet: refused
        node.core.namespaces.limits = dataclasses.replace(node.core.limits, namespace_idle_s=0.0)
        node.core.reap()  # idle and empty now: both retired
        lookup = pb.LookupRequest(epoch=servicer.epoch, ns_id=kept[0], keys=b"k" * 16)
        with pytest.raises(_Aborted) as aborted:
            servicer.Lookup(lookup, _Context())  # type: ignore[arg-type]
        assert "not registered" in str(aborted.value)
        after = tracemalloc.take_snapshot()
        gate_file = inspect.getsourcefile(type(servicer))  # the gate lives in the gRPC front
        assert gate_file is not None and Path(gate_file).is_file()
        grown = sum(
            stat.size_diff
            for stat in after.compare_to(before, "filename")
            if stat.traceback[0].filename == gate_file
        )
        assert grown < 16 << 10, f"the gate grew by {grown} bytes"
    finally:
        tracemalloc.stop()
        _CALLER.reset(token)
        node.close()
