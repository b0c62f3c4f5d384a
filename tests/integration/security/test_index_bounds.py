"""What one credential can make the index hold: followers of registered sources (threads),
namespaces (memory). Real index processes (memory and Redis backends); threads and RSS read
from /proc with generous bounds."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kvtier.core.errors import ErrorCode
from kvtier.index.api import LocationKind, Registration
from kvtier.index.proto import index_pb2 as pb
from kvtier.testing.ports import free_port
from kvtier.testing.services import Service

from support.index_rig import client, namespace, refused, rss_bytes, start_index, threads
from support.vllm_fixtures import wait_for

MAX_FOLLOWERS = 10
MAX_NAMESPACES = 40
SLACK = 6  # threads that come and go (gRPC, HTTP workers)


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest) -> Iterator[Service]:
    url = request.getfixturevalue("redis_server").url if request.param == "redis" else None
    service = start_index(
        redis_url=url,
        env={
            "KVTIER_INDEX__MAX_DYNAMIC_FOLLOWERS": str(MAX_FOLLOWERS),
            "KVTIER_INDEX__MAX_NAMESPACES": str(MAX_NAMESPACES),
            "KVTIER_INDEX__HEARTBEAT_TIMEOUT_S": "3",
        },
    )
    try:
        yield service
    finally:
        service.stop()


def _dead_store(name: str) -> Registration:
    """A node store nobody runs: its follower can never connect."""
    endpoint = {"store": f"127.0.0.1:{free_port()}"}
    return Registration(name, LocationKind.NODE, endpoints=endpoint)


def test_followers_of_registrations_are_bounded_and_stopped(index: Service) -> None:
    node, admin = client(index, "node"), client(index, "admin")
    pid = index.proc.pid

    def followed() -> int:
        return len(admin.stats()["sources"])

    admin.stats()  # the server's threads for a call exist before the baseline
    base = threads(pid)
    for i in range(MAX_FOLLOWERS):
        node.register(_dead_store(f"dead-{i}"))
    err = refused(node.register, _dead_store("one-too-many"))
    assert err.code is ErrorCode.LIMIT_EXCEEDED and "max_dynamic_followers" in err.message
    wait_for(lambda: followed() == MAX_FOLLOWERS, 20, what="followers started")
    assert threads(pid) <= base + MAX_FOLLOWERS + SLACK
    # unregistered: their followers stop
    for i in range(MAX_FOLLOWERS):
        assert node.unregister(f"dead-{i}")
    wait_for(lambda: followed() == 0, 30, what="followers stopped")
    wait_for(lambda: threads(pid) <= base + SLACK, 30, what="their threads gone")
    # reaped (silent past heartbeat_timeout_s, never unregistered): they stop too, and the
    # bound counts followed registrations that are up, so new ones are taken
    for i in range(MAX_FOLLOWERS):
        node.register(_dead_store(f"again-{i}"))
    wait_for(lambda: followed() == MAX_FOLLOWERS, 20, what="followers started")
    wait_for(lambda: all(i.status.value == "down" for i in admin.locations()), 60, what="reaped")
    wait_for(lambda: followed() == 0, 30, what="reaped followers stopped")
    wait_for(lambda: threads(pid) <= base + SLACK, 30, what="their threads gone")
    node.register(_dead_store("after-the-reaping"))
    node.close()
    admin.close()


def test_namespaces_are_bounded_in_number_and_size(index: Service) -> None:
    engine = client(index, "engine-all")
    for i in range(MAX_NAMESPACES):
        engine.register_namespace(namespace(None, model=f"m{i}"))
    err = refused(engine.register_namespace, namespace(None, model="one-too-many"))
    assert err.code is ErrorCode.LIMIT_EXCEEDED and "max_namespaces" in err.message
    assert engine.register_namespace(namespace(None, model="m0"))  # a known one: fine
    # a huge definition is refused before it is parsed or kept, however many are sent
    pid = index.proc.pid
    rss = rss_bytes(pid)
    huge = json.dumps({**namespace(None).model_dump(), "model": "x" * (512 << 10)})
    request = pb.RegisterNamespaceRequest(namespace_json=huge)
    for _ in range(200):  # 100 MiB of definitions
        err = refused(engine._call, "RegisterNamespace", request)
        assert err.code is ErrorCode.INVALID_ARGUMENT and "max_namespace_bytes" in err.message
    assert rss_bytes(pid) - rss < 48 << 20
    engine.close()
