"""Router replicas that agree (router/peers.py), in this process: three replicas over one
index's change feed (index/server/feed.py), each with its own replica of the index, driven
step by step as their threads drive them. What one replica alone sees (requests in flight,
an ejection, a prompt just routed) reaches the others' decisions; given the same request and
the same shared state, they choose the same instance; a replica that stops sharing is
forgotten after its shares' TTL. Across real router processes:
tests/integration/test_router_replicas.py."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvtier.core.config.router import BackendConfig, RouterConfig
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.index.api import LocationKind, Registration
from kvtier.index.backends.memory import MemoryIndex
from kvtier.index.client.replica import IndexReplica
from kvtier.index.server.feed import ChangeFeed, FeedingIndex
from kvtier.router.backends import Backends
from kvtier.router.core import RoutingCore
from kvtier.router.peers import PeerShares, replica_name
from kvtier.router.policies import make_policy

NS = Namespace(model="m", dtype="bf16", num_layers=1, num_kv_heads=1, head_size=8)
NAMES = ("i0", "i1", "i2")
PROMPT = list(range(3, 3 + 256 * 4))


@dataclass
class Replica:
    replica: IndexReplica
    core: RoutingCore
    peers: PeerShares

    def sync(self) -> None:
        self.replica.sync_once()

    def route(self, prompt: list[int] = PROMPT) -> str:
        return self.core.route(prompt, len(prompt), "s").backend.name


def _index() -> FeedingIndex:
    index = FeedingIndex(MemoryIndex(), ChangeFeed())
    ns_id = index.register_namespace(NS)
    for name in NAMES:
        index.register(Registration(name, LocationKind.INSTANCE, (ns_id,), node="n0"))
    return index


def _replica(source: FeedingIndex, ttl_s: float = 5.0) -> Replica:
    config = RouterConfig(
        policy="kvtier",
        backends=[BackendConfig(url=f"http://{n}.invalid:8000", name=n) for n in NAMES],
    )
    replica = IndexReplica(source, max_stale_s=60, wait_s=0, start=False)
    replica.sync_once()  # the snapshot
    backends = Backends(config, replica)
    backends.refresh()
    core = RoutingCore(backends, make_policy("kvtier"), replica, speculative_s=30)
    peers = PeerShares(
        replica_name("r"), backends, replica, core.speculative.record, ttl_s=ttl_s, start=False
    )
    core.peers = peers
    return Replica(replica, core, peers)


def _exchange(*replicas: Replica) -> None:
    """Every replica shares, then every replica reads the feed."""
    for r in replicas:
        r.peers.share_once()
    for r in replicas:
        r.sync()


def test_in_flight_load_on_one_replica_steers_the_others() -> None:
    source = _index()
    a, b, c = (_replica(source) for _ in range(3))
    _exchange(a, b, c)
    first = b.route()
    assert c.route() == first  # the same request, the same state: the same choice
    busy = a.core.backends.all()[NAMES.index(first)]
    for _ in range(8):  # a has 8 long prompts in flight there; b and c do not see them alone
        a.core.backends.dispatched(busy, 30_000)
    _exchange(a, b, c)
    assert b.route() != first and c.route() == b.route()
    seen = b.core.backends.all()[NAMES.index(first)].load()
    assert seen.running == 8 and seen.pending_prefill_tokens == 8 * 30_000
    assert sorted(b.peers.peers()) == sorted([a.peers.name, c.peers.name])


def test_an_ejection_by_one_replica_keeps_the_others_away() -> None:
    source = _index()
    a, b = _replica(source), _replica(source)
    _exchange(a, b)
    first = b.route()
    a.core.backends.eject(a.core.backends.all()[NAMES.index(first)], "connection refused")
    _exchange(a, b)
    assert first not in {x.name for x in b.core.backends.routable()}
    assert b.route() != first


def test_a_prompt_routed_by_one_replica_counts_as_held_on_its_instance() -> None:
    source = _index()
    a, b = _replica(source), _replica(source)
    _exchange(a, b)
    chosen = a.route()
    _exchange(a, b)  # a's share carries the prompt's keys
    keys = prompt_keys(NS, PROMPT)
    assert b.core.speculative.leading(keys, chosen) == len(keys)
    assert b.route() == chosen  # the burst's next request follows it, not a cold instance


def test_a_replica_hears_not_its_own_share_and_forgets_a_silent_one() -> None:
    source = _index()
    a, b = _replica(source, ttl_s=0.2), _replica(source, ttl_s=0.2)
    a.core.backends.dispatched(a.core.backends.all()[0], 100)
    _exchange(a, b)
    assert a.peers.peers() == [p for p in a.peers.peers() if not p.endswith(a.peers.name)]
    assert a.core.backends.all()[0].peer.in_flight == 0  # its own load is not counted twice
    assert b.core.backends.all()[0].peer.in_flight == 1
    time.sleep(0.3)  # a stops sharing (dead, partitioned): its share lapses
    b.peers.share_once()
    assert b.peers.peers() == [] and b.core.backends.all()[0].peer.in_flight == 0


def test_shares_that_eject_every_instance_steer_nothing() -> None:
    """A share (a router's credential) can steer the others, never take them down: with every
    instance ejected by shares alone, a replica routes on its own view."""
    source = _index()
    a, b = _replica(source), _replica(source)
    for backend in a.core.backends.all():
        a.core.backends.eject(backend, "a lying or partitioned replica")
    _exchange(a, b)
    assert {x.name for x in b.core.backends.routable()} == set(NAMES)
    b.core.backends.eject(b.core.backends.all()[0], "its own failure")
    assert {x.name for x in b.core.backends.routable()} == set(NAMES[1:])
