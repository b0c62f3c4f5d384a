"""A router's replica of the index (index/client/replica.py) against a real ``kvtier index
serve`` process with credentials: it follows the change feed as a router's credential may; an
engine's credential can neither follow nor snapshot (the feed carries every tenant's
namespaces and chunks) nor share a router's view; an index on Redis, which keeps no feed,
leaves the router asking the index, with the reason."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.core.chunks import Tier
from kvtier.core.errors import ErrorCode
from kvtier.core.keys import prompt_keys
from kvtier.index.api import ChunkOp, LocationKind, Query, Registration
from kvtier.index.client.changes import InstanceShare, RouterShare
from kvtier.index.client.replica import IndexReplica
from kvtier.store.api.events import EventKind
from kvtier.testing.services import Service

from support.index_rig import NS_A, NS_B, client, refused, start_index
from support.vllm_fixtures import wait_for

TOKEN_IDS = list(range(500, 500 + 6 * 16))


@pytest.fixture
def index() -> Iterator[Service]:
    service = start_index()
    try:
        yield service
    finally:
        service.stop()


def _held(index, ns_id: bytes) -> list[tuple[str, dict, int]]:
    result = index.query_one(Query(ns_id, keys=prompt_keys(NS_B, TOKEN_IDS)))
    return [(h.location, dict(h.runs), h.total) for h in result.holdings]


def test_a_router_replica_follows_every_tenants_writes(index: Service) -> None:
    reader, a, b = (client(index, who) for who in ("reader", "engine-a", "engine-b"))
    replica = IndexReplica(reader, max_stale_s=30)
    try:
        ns_a, ns_b = a.register_namespace(NS_A), b.register_namespace(NS_B)
        keys = prompt_keys(NS_B, TOKEN_IDS)
        b.register(Registration("vllm-b", LocationKind.INSTANCE, (ns_b,), node="n1"))
        a.register(Registration("vllm-a", LocationKind.INSTANCE, (ns_a,), node="n1"))
        b.apply("vllm-b", [ChunkOp(EventKind.STORED, Tier.GPU, ns_b, tuple(keys[:4]))])
        want = [("vllm-b", {Tier.GPU: 4}, 4)]
        assert _held(reader, ns_b) == want
        wait_for(lambda: _held(replica.copy, ns_b) == want, what="the replica following")
        b.apply("vllm-b", [ChunkOp(EventKind.REMOVED, Tier.GPU, ns_b, tuple(keys[2:4]))])
        want = [("vllm-b", {Tier.GPU: 2}, 2)]
        wait_for(lambda: _held(replica.copy, ns_b) == want, what="a removal followed")
        assert _held(replica, ns_b) == _held(reader, ns_b) == want  # fresh: from the copy
        assert replica.fresh() and replica.snapshots == 1 and replica.unsupported is None
        assert {i.registration.location for i in replica.locations()} == {"vllm-a", "vllm-b"}
    finally:
        replica.close()


def test_an_engine_credential_can_neither_follow_snapshot_nor_share(index: Service) -> None:
    """Nor steer the routers: sharing a router's view is a router's (reader) call."""
    engine = client(index, "engine-b")
    engine.register_namespace(NS_B)
    share = RouterShare("not-a-router", 1.0, (InstanceShare("vllm-b", ejected_for_s=60),))
    for call, args in ((engine.follow, ("", 0)), (engine.snapshot, ()), (engine.share, (share,))):
        assert refused(call, *args).code is ErrorCode.PERMISSION_DENIED


def test_an_index_on_redis_keeps_no_feed_and_the_router_asks_it(redis_server) -> None:
    service = start_index(redis_url=redis_server.url)
    reader, b = client(service, "reader"), client(service, "engine-b")
    replica = IndexReplica(reader)
    try:
        wait_for(lambda: replica.unsupported, what="the index saying it keeps no feed")
        assert "share a Redis" in (replica.unsupported or "")
        ns_b = b.register_namespace(NS_B)
        b.register(Registration("vllm-b", LocationKind.INSTANCE, (ns_b,), node="n1"))
        keys = prompt_keys(NS_B, TOKEN_IDS)
        b.apply("vllm-b", [ChunkOp(EventKind.STORED, Tier.GPU, ns_b, tuple(keys[:3]))])
        assert not replica.fresh()
        assert _held(replica, ns_b) == [("vllm-b", {Tier.GPU: 3}, 3)]  # asked the index
    finally:
        replica.close()
        service.stop()
