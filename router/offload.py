"""Selective prefill offload: a heavy prefill runs on a less loaded instance, its decode stays.

Full prefill/decode separation hurts agentic traffic (every turn would move its whole KV);
*selective* offload of the heavy prefills can help: when a request's uncached tokens are many
and its session's instance (``home``: the policy's choice) has a queue, another instance
(the ``helper``) computes the prompt instead. The router sends the helper a copy of the
request that generates one token; the helper's connector saves the prompt's chunks to its
node's pool, and the index hears of them; then the router forwards the original request to
home, whose connector loads the chunks as a node-DRAM hit (the helper on its node) or a remote
hit (another node's pool), and decodes there, beside the session's other turns.

The gate (``policies.OffloadGate``, shared with ``kvtier trace simulate``) is the cost model
the ``kvtier`` policy scores with, in recompute-equivalent tokens (``TierCosts``: what a
tier's load costs against computing the same tokens):

- here:    home's pending prefill + what home must compute of the prompt;
- offload: max(helper's pending prefill + what the helper must compute, home's pending
  prefill: the request still waits its turn there) + loading, at home, what home lacks from
  the tier the helper's chunks land in (DRAM on the helper's node, remote otherwise).

Offload when it is cheaper by ``router.offload_margin``, with at most
``router.offload_max_concurrent`` in flight. Never inexact: home's connector loads only
chunks that are committed and checksummed, and computes whatever did not arrive (a helper
that fails, times out or is slow only costs the wait, at most ``router.offload_timeout_s``).

Threading: ``choose`` runs on decision threads; the in-flight count has a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.core.config.router import RouterConfig
from kvtier.router.backends import Backend
from kvtier.router.core import Routed
from kvtier.router.policies import OffloadGate, TierCosts


@dataclass(frozen=True)
class Offload:
    helper: Backend
    here_tokens: float  # the model's cost of prefilling at home, recompute-equivalent tokens
    offload_tokens: float  # its cost through the helper


class PrefillOffload:
    def __init__(self, config: RouterConfig, costs: TierCosts | None = None) -> None:
        self.config = config
        self.costs = costs or TierCosts()
        self.gate = OffloadGate(self.costs, config.offload_min_tokens, config.offload_margin)
        self._in_flight = 0
        self._lock = threading.Lock()
        self.offloaded = self.declined = 0

    def choose(self, routed: Routed, backends: Sequence[Backend]) -> Offload | None:
        """The helper to prefill ``routed``'s prompt on, or None (prefill at home)."""
        tokens = routed.prompt_tokens
        by_name = {c.name: c for c in routed.candidates}
        home = by_name.get(routed.backend.name)
        if home is None:
            return None
        home_pending = home.load.pending_prefill_tokens
        here = self.gate.here(home.coverage, home_pending, tokens)
        if here is None:
            return None
        best: Offload | None = None
        for backend in backends:
            helper = by_name.get(backend.name)
            if helper is None or backend is routed.backend:
                continue
            node = routed.backend.node
            cost = self.gate.through(
                home.coverage, home_pending, helper.coverage,
                helper.load.pending_prefill_tokens, bool(node) and node == backend.node, tokens,
            )  # fmt: skip
            if best is None or cost < best.offload_tokens:
                best = Offload(backend, here, cost)
        if best is None or not self.gate.worth(here, best.offload_tokens):
            return None
        return best

    def begin(self) -> bool:
        """Take an offload slot; False when ``offload_max_concurrent`` are in flight."""
        with self._lock:
            if self._in_flight >= self.config.offload_max_concurrent:
                self.declined += 1
                return False
            self._in_flight += 1
            self.offloaded += 1
            return True

    def end(self) -> None:
        with self._lock:
            self._in_flight -= 1


def prefill_only(body: dict) -> dict:
    """The request as a helper runs it: the same prompt, one token, not streamed, one choice,
    no logprobs (only its KV is wanted)."""
    out = {
        k: v
        for k, v in body.items()
        if k not in ("stream", "stream_options", "n", "logprobs", "top_logprobs", "best_of")
    }
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out
