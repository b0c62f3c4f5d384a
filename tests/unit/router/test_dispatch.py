"""Requests decided together are counted as load before the next decision reads it.

The proxy and the endpoint picker run ``RoutingCore.route`` on threads (``asyncio.to_thread``),
so two requests arriving together are decided side by side. Before ``route(dispatch=True)``
the caller counted a request as its instance's load only once ``route`` had returned: a
decision made in between saw that instance idle, and in ``kvtier bench cluster`` (run 8b) two
MEDIUM prompts sent 0.12 s apart were decided on the same loads, both went to one instance,
and were that repeat's two slowest requests.
Here both decisions are held until each has passed its index query (a burst), then race for
the choice; the same prompt twice, so that their tie-break is the same and only the load can
tell them apart.
"""

from __future__ import annotations

import threading

import pytest

from kvtier.core.config.router import BackendConfig, RouterConfig
from kvtier.router.backends import Backends
from kvtier.router.core import RoutingCore
from kvtier.router.policies import make_policy

NAMES = ("i0", "i1")
PROMPT = list(range(7, 307))  # 300 tokens, no index: nothing cached anywhere


def _core(policy: str) -> RoutingCore:
    config = RouterConfig(
        policy=policy,
        backends=[BackendConfig(url=f"http://{n}.invalid:8000", name=n) for n in NAMES],
    )
    backends = Backends(config)
    backends.refresh()
    return RoutingCore(backends, make_policy(policy))


@pytest.mark.parametrize("policy", ["kvtier", "lmetric", "least-load", "hybrid"])
def test_two_requests_decided_together_go_to_the_two_idle_instances(policy: str) -> None:
    core = _core(policy)
    burst = threading.Barrier(2)
    coverage = core._coverage

    def held_coverage(*args, **kwargs):  # type: ignore[no-untyped-def]
        found = coverage(*args, **kwargs)
        burst.wait(5)  # both requests past their index query: their choices race
        return found

    core._coverage = held_coverage  # type: ignore[method-assign]
    chosen: list[str] = []

    def decide() -> None:
        chosen.append(core.route(PROMPT, len(PROMPT), "s", dispatch=True).backend.name)

    threads = [threading.Thread(target=decide) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(chosen) == sorted(NAMES)
    loads = {b.name: (b.pending_prefill_tokens, b.in_flight) for b in core.backends.all()}
    assert loads == {name: (len(PROMPT), 1) for name in NAMES}


def test_without_dispatch_a_decision_counts_nothing() -> None:
    """Callers that only ask (the simulator, benchmarks, replicas comparing choices) change
    no load: the same request asked twice gets the same answer."""
    core = _core("kvtier")
    first = core.route(PROMPT, len(PROMPT), "s").backend.name
    assert core.route(PROMPT, len(PROMPT), "s").backend.name == first
    assert all(b.pending_prefill_tokens == 0 and b.in_flight == 0 for b in core.backends.all())
