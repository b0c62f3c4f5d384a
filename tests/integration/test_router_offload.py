"""Selective prefill offload through a real router process (router/offload.py): a session's
heavy turn, its instance queued, prefills first on an idle helper (one token, not streamed)
and then goes whole to its own instance; a helper that fails costs the request nothing but
the try. Instances are stubs (they save no KV: the router waits ``offload_settle_s`` for
chunks that never come, and says so); exactness through real engines is the connector's
(a load gives exactly a recompute's logprobs, or the tokens are computed)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvtier.core.keys import Namespace
from kvtier.index.api import LocationKind, Registration
from kvtier.index.client.changes import InstanceShare, RouterShare
from kvtier.index.client.grpc import GrpcIndexClient
from kvtier.testing.services import Service

from support.router_rig import metric, router_url, start_index, start_router, wait_for
from support.stub_backend import StubBackend

NS = Namespace(model="m", dtype="bf16", num_layers=1, num_kv_heads=1, head_size=8)
NAMES = ("a", "b", "c")


@dataclass
class Fleet:
    index: Service
    stubs: dict[str, StubBackend]
    router: Service
    log: Path

    @property
    def url(self) -> str:
        return router_url(self.router)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    index = start_index()
    stubs = {name: StubBackend(name) for name in NAMES}
    router: Service | None = None
    try:
        client = GrpcIndexClient(index.address, 5)
        ns_id = client.register_namespace(NS)
        for name, stub in stubs.items():
            client.register(
                Registration(
                    name, LocationKind.INSTANCE, (ns_id,), f"node-{name}", {"api": stub.url}
                )
            )
        client.close()
        log = tmp_path / "decisions.jsonl"
        env = {
            "KVTIER_ROUTER__POLICY": "sticky",  # the session stays home, queued or not
            "KVTIER_ROUTER__OFFLOAD": "true",
            "KVTIER_ROUTER__OFFLOAD_MIN_TOKENS": "1024",
            "KVTIER_ROUTER__OFFLOAD_SETTLE_S": "0.2",
            "KVTIER_ROUTER__SCRAPE_S": "3600",
            "KVTIER_ROUTER__PROBE_S": "3600",
        }
        router = start_router(["--index", index.address, "--decision-log", str(log)], env)
        yield Fleet(index, stubs, router, log)
    finally:
        if router is not None:
            router.stop()
        for stub in stubs.values():
            stub.stop()
        index.stop()


def _turn(fleet: Fleet, prompt: list[int]) -> httpx.Response:
    body = {"model": "stub", "prompt": prompt, "max_tokens": 8, "user": "session-1"}
    return httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=30)


def _queue_at(fleet: Fleet, pending: dict[str, float], stop: threading.Event) -> None:
    """Another router replica's share: these instances have prefills queued."""
    client = GrpcIndexClient(fleet.index.address, 5)
    share = RouterShare(
        "load-injector", 2.0, tuple(InstanceShare(n, 1, p) for n, p in pending.items())
    )
    while not stop.is_set():
        client.share(share)
        stop.wait(0.2)
    client.close()


def test_a_queued_sessions_heavy_turn_prefills_on_an_idle_helper(fleet: Fleet) -> None:
    first = list(range(10, 10 + 2048))
    assert _turn(fleet, first).status_code == 200
    home = next(n for n, s in fleet.stubs.items() if s.state.received)
    helper = next(n for n in NAMES if n != home)
    others = [n for n in NAMES if n not in (home, helper)]
    stop = threading.Event()
    injector = threading.Thread(
        target=_queue_at, args=(fleet, {home: 6000, **dict.fromkeys(others, 6000)}, stop)
    )
    injector.start()
    try:
        wait_for(
            lambda: "load-injector" in str(httpx.get(f"{fleet.url}/readyz").json()),
            what="the router hears the queue",
        )
        second = first + list(range(50_000, 50_000 + 4096))  # the next turn: 4k new tokens
        resp = _turn(fleet, second)
        assert resp.status_code == 200 and resp.json()["served_by"] == home
        helped = fleet.stubs[helper].state.received
        assert [r["prompt"] for r in helped] == [second]  # the same prompt, first, on the helper
        assert helped[0]["max_tokens"] == 1 and "stream" not in helped[0]
        assert fleet.stubs[home].state.received[-1]["max_tokens"] == 8  # the original, at home
        assert metric(fleet.url, 'kvtier_router_prefill_offloads_total{outcome="unsettled"}') == 1

        fleet.stubs[helper].state.mode = "503"  # a helper that fails: home computes, as before
        third = list(range(80_000, 80_000 + 4096))  # a new prompt: no one holds any of it
        resp = _turn(fleet, third)
        assert resp.status_code == 200 and resp.json()["served_by"] == home
        assert metric(fleet.url, 'kvtier_router_prefill_offloads_total{outcome="failed"}') == 1
    finally:
        stop.set()
        injector.join()
