"""Three router replicas as real processes over one real index (router/peers.py): what one
alone sees reaches the others' decisions through the index's change feed, a replica killed
mid-run costs only its own requests (the client retries them through another, which
succeeds), and the others keep routing and forget it. Instances are stubs (a hang on demand:
requests in flight that a test can count).

Scraping /metrics is off after the first scrape (``scrape_s`` 1 h), so an instance's load a
replica logs can only come from its own accounting and the others' shares."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvtier.core.keys import Namespace
from kvtier.index.api import LocationKind, Registration
from kvtier.index.client.grpc import GrpcIndexClient
from kvtier.testing.services import Service

from support.router_rig import router_url, start_index, start_router, wait_for
from support.stub_backend import StubBackend

NS = Namespace(model="m", dtype="bf16", num_layers=1, num_kv_heads=1, head_size=8)


@dataclass
class Fleet:
    index: Service
    stubs: dict[str, StubBackend]
    routers: list[Service]
    logs: list[Path]

    def url(self, i: int) -> str:
        return router_url(self.routers[i])

    def decisions(self, i: int) -> list[dict]:
        text = self.logs[i].read_text() if self.logs[i].exists() else ""
        return [json.loads(line) for line in text.splitlines()]

    def _peer_state(self, i: int) -> dict:
        return dict(httpx.get(f"{self.url(i)}/readyz", timeout=5).json().get("peers", {}))

    def peers(self, i: int) -> list[str]:
        return list(self._peer_state(i).get("peers", []))

    def received(self, i: int) -> int:
        """Shares of the other replicas router ``i`` applied so far."""
        return int(self._peer_state(i).get("received", 0))


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    index = start_index()
    stubs = {name: StubBackend(name) for name in ("x", "y")}
    routers: list[Service] = []
    try:
        client = GrpcIndexClient(index.address, 5)
        ns_id = client.register_namespace(NS)
        for name, stub in stubs.items():
            client.register(
                Registration(
                    name, LocationKind.INSTANCE, (ns_id,), endpoints={"api": stub.url}, node=name
                )
            )
        client.close()
        env = {"KVTIER_ROUTER__SCRAPE_S": "3600", "KVTIER_ROUTER__PROBE_S": "3600"}
        logs = [tmp_path / f"decisions-{i}.jsonl" for i in range(3)]
        for i in range(3):
            routers.append(
                start_router(
                    ["--index", index.address, "--decision-log", str(logs[i])],
                    {**env, "KVTIER_ROUTER__NAME": f"router-{i}"},
                )
            )
        fleet = Fleet(index, stubs, routers, logs)
        for i in range(3):
            wait_for(lambda i=i: len(fleet.peers(i)) == 2, what=f"router {i} hears the others")
        yield fleet
    finally:
        for router in routers:
            if router.proc.poll() is None:
                router.stop()
        for stub in stubs.values():
            stub.stop()
        index.stop()


def _post(url: str, prompt: list[int], timeout: float = 30) -> httpx.Response:
    body = {"model": "stub", "prompt": prompt, "max_tokens": 4}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def _logged_running(fleet: Fleet, i: int, instance: str) -> int:
    last = fleet.decisions(i)[-1]
    return next(c["running"] for c in last["candidates"] if c["name"] == instance)


def test_replicas_see_each_others_load_and_survive_a_dead_one(fleet: Fleet) -> None:
    x = fleet.stubs["x"]
    x.state.mode = "hang"
    failed: list[int] = []

    def through_a(n: int) -> None:
        try:
            _post(fleet.url(0), list(range(n, n + 600)), timeout=60)
        except httpx.HTTPError:
            failed.append(n)  # router 0 killed under it: the client retries it elsewhere

    clients = [threading.Thread(target=through_a, args=(n * 1000,)) for n in range(6)]
    for t in clients:
        t.start()
    # router 0 spreads them by its own load: some hang on x (in flight), the rest are answered
    wait_for(lambda: len(x.state.received) >= 1 and threading.active_count() > 1, what="hung")
    wait_for(lambda: sum(t.is_alive() for t in clients) == len(x.state.received), what="settled")
    hung = len(x.state.received)
    for i in (1, 2):  # a few shares of router 0's arrive after the last request settled
        heard = fleet.received(i)
        wait_for(lambda i=i, heard=heard: fleet.received(i) >= heard + 4, what="shares heard")

    def seen_by(i: int) -> bool:
        assert _post(fleet.url(i), list(range(90_000 + i, 90_600 + i))).status_code == 200
        return _logged_running(fleet, i, "x") == hung

    # routers 1 and 2 never sent to x themselves (scraping is off): what they log is router 0's
    for i in (1, 2):
        wait_for(lambda i=i: seen_by(i), timeout=10, what=f"router {i} sees router 0's load")

    os.kill(fleet.routers[0].proc.pid, signal.SIGKILL)
    for t in clients:
        t.join(timeout=30)
    assert len(failed) == hung  # exactly the requests router 0 held were lost to the client
    x.state.mode = "ok"
    for n in failed:  # the client's retry through another replica succeeds
        assert _post(fleet.url(1 + n % 2), list(range(n, n + 600))).status_code == 200

    # the others keep routing and forget the dead one once its share lapses
    def forgot_its_load(i: int) -> bool:
        assert _post(fleet.url(i), list(range(70_000, 70_600))).status_code == 200
        return _logged_running(fleet, i, "x") == 0

    for i in (1, 2):
        wait_for(lambda i=i: len(fleet.peers(i)) == 1, timeout=10, what="router 0 forgotten")
        # its load leaves the view by the next share interval after its share lapsed
        wait_for(lambda i=i: forgot_its_load(i), timeout=10, what="its load forgotten")


def test_two_replicas_given_the_same_request_choose_the_same_instance(fleet: Fleet) -> None:
    for n in range(6):
        prompt = list(range(n * 5000, n * 5000 + 700))
        for i in (1, 2):
            heard = fleet.received(3 - i)
            assert _post(fleet.url(i), prompt).status_code == 200
            # the other has heard this one's share since its request ended: the same state
            wait_for(lambda i=i, heard=heard: fleet.received(3 - i) >= heard + 6, what="shared")
        chosen = [fleet.decisions(i)[-1]["chosen"] for i in (1, 2)]
        assert chosen[0] == chosen[1], (n, chosen)
