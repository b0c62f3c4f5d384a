"""The selective prefill offload gate (router/offload.py): offload a heavy prefill only when
a helper makes it cheaper than prefilling at its home by the margin, by the same cost model
the kvtier policy scores with; never a light one, never when home holds most of the prompt."""

from __future__ import annotations

from kvtier.core.config.router import RouterConfig
from kvtier.router.backends import Backend
from kvtier.router.core import Routed
from kvtier.router.offload import PrefillOffload, prefill_only
from kvtier.router.policies import Candidate, Coverage, Decision, Load

TOKENS = 16_384


def _routed(home_pending: float, helper_pending: float, home_gpu: int = 0) -> tuple:
    home, helper = Backend("home", "http://h", node="n1"), Backend("helper", "http://x", node="n2")
    held = Coverage(home_gpu, home_gpu, home_gpu)
    candidates = [
        Candidate("home", Load(pending_prefill_tokens=home_pending), held),
        Candidate("helper", Load(pending_prefill_tokens=helper_pending)),
    ]
    routed = Routed(home, Decision(0, "sticky"), candidates, TOKENS, 0, 0.0)
    return routed, [home, helper]


def _gate(**overrides: object) -> PrefillOffload:
    settings: dict = {"offload": True, "offload_min_tokens": 4096, **overrides}
    return PrefillOffload(RouterConfig(**settings))


def test_a_heavy_prefill_behind_a_queue_goes_to_an_idle_helper() -> None:
    routed, backends = _routed(home_pending=40_000, helper_pending=0)
    choice = _gate().choose(routed, backends)
    assert choice is not None and choice.helper.name == "helper"
    assert choice.offload_tokens < choice.here_tokens * 0.8


def test_no_offload_without_a_queue_at_home_or_with_a_busier_helper() -> None:
    gate = _gate()
    assert gate.choose(*_routed(home_pending=0, helper_pending=0)) is None  # it only adds a load
    assert gate.choose(*_routed(home_pending=40_000, helper_pending=60_000)) is None


def test_no_offload_of_a_light_prefill_or_of_a_prompt_home_holds() -> None:
    gate = _gate()
    assert gate.choose(*_routed(40_000, 0, home_gpu=TOKENS - 1024)) is None
    light = _gate(offload_min_tokens=TOKENS + 1)
    assert light.choose(*_routed(40_000, 0)) is None


def test_slots_bound_the_offloads_in_flight() -> None:
    gate = _gate(offload_max_concurrent=1)
    assert gate.begin() and not gate.begin()
    gate.end()
    assert gate.begin()


def test_the_helper_runs_one_token_of_the_same_prompt() -> None:
    body = {"model": "m", "prompt": [1, 2, 3], "stream": True, "n": 3, "max_tokens": 99,
            "logprobs": 5, "temperature": 0.7}  # fmt: skip
    assert prefill_only(body) == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1,
                                  "temperature": 0.7}  # fmt: skip
