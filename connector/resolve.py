"""Tier-first resolution of one prompt: how much of it the node store holds past vLLM's own
hit, then how much more another node's store holds (pulled here), all leased for the load.

A ``LookupOutcome`` remembers, per TP rank, which store incarnation (epoch) its extents belong
to: a store that restarts between the lookup and the load has another pool, and extents of the
old one must never be copied out of the new one (the load fails and is recomputed instead).

Every lease taken is either handed to the outcome or released before returning, including
when a later call raises, so a failed lookup leaks nothing until its TTL.

Threading: ``resolve`` runs on a ``kvtier-lookup`` thread (or inline for an embedded store);
it touches the request only through ``RequestState.keys``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.connector.config import ConnectorConfig
from kvtier.connector.counters import C, Counter
from kvtier.connector.layout import KvGeometry, ModelIdentity
from kvtier.connector.remote import RemoteResolver
from kvtier.connector.requests import RequestState
from kvtier.errors import ErrorCode, KvtierError
from kvtier.tiers.base import ChunkLocation
from kvtier.tiers.cpu.tier import CpuTier

log = logging.getLogger(__name__)

Count = Callable[[Counter, float], None]


@dataclass
class LookupOutcome:
    """What the tiers hold past ``computed`` tokens (vLLM's own hit) for one request."""

    computed: int  # vLLM's local hit this outcome was computed for
    first_chunk: int  # chunk holding token ``computed``
    hits: dict[int, list[ChunkLocation]] = field(default_factory=dict)  # per rank, leased
    epochs: dict[int, int] = field(default_factory=dict)  # per rank: incarnation of the hits
    lease_ids: list[int] = field(default_factory=list)  # every lease taken (all ranks, tiers)
    leased_at: float = field(default_factory=time.monotonic)
    tokens: int = 0  # tokens vLLM may skip (0 when the run is not worth a load)
    cpu_tokens: int = 0  # of which the node store held before the lookup (the rest: remote)
    consumed: bool = False  # turned into a LoadJob
    released: bool = False
    lease_lost: bool = False  # a renewal found a lease gone: never load from it


class TierResolver:
    def __init__(
        self,
        config: ConnectorConfig,
        geometry: KvGeometry,
        identity_of: Callable[[], ModelIdentity],
        tier: CpuTier,
        remote: RemoteResolver | None,
        count: Count,
    ) -> None:
        self.config = config
        self.geometry = geometry
        self._identity_of = identity_of
        self.tier = tier
        self.remote = remote
        self._count = count
        self._adapters = _adapter_fingerprints()

    # -- namespaces --------------------------------------------------------------------------

    def namespaces(self, state: RequestState) -> dict[int, bytes]:
        """The request's namespace id per TP rank, registered with the store (by the tier, at
        most once per namespace). Raises when the store is unreachable or refuses."""
        if state.ns_ids is not None:
            return state.ns_ids
        identity = self._identity_of()
        lora_fp = self._adapters.of(state.lora_path) if state.lora_path else ""
        ns_ids = {}
        for rank in range(identity.tp_size):
            namespace = identity.namespace(self.geometry, rank, state.salt, lora_fp)
            ns_ids[rank] = self.tier.namespace_id(namespace, self.geometry.chunk_bytes)
        state.bind_namespaces(ns_ids, self.geometry.chunk_tokens)
        return ns_ids

    # -- lookups -----------------------------------------------------------------------------

    def resolve(self, state: RequestState, computed: int) -> LookupOutcome:
        """Tier-first lookup for every TP rank: the node store's run (leased), then the run
        after it pulled from another node's store into this one (leased too)."""
        geo = self.geometry
        request = state.request
        first = computed // geo.chunk_tokens
        total_chunks = request.num_tokens // geo.chunk_tokens
        outcome = LookupOutcome(computed, first)
        if total_chunks <= first:
            return outcome
        ns_ids = self.namespaces(state)
        keys = {rank: state.keys(rank, total_chunks, geo.chunk_tokens)[first:] for rank in ns_ids}
        try:
            local = self._lookup_local(ns_ids, keys, outcome)
            remote = self._pull_remote(ns_ids, keys, local, outcome) if self.remote else 0
        except KvtierError as exc:
            if exc.code is ErrorCode.UNKNOWN_NAMESPACE:  # the store forgot it: register anew
                for ns_id in ns_ids.values():
                    self.tier.forget_namespace(ns_id)
                state.ns_ids = None
            self.release(outcome)
            raise
        except BaseException:
            self.release(outcome)  # leases taken before the failure: give them back now
            raise
        # Leave vLLM the prompt's last block to compute, as its own prefix cache does: a sync
        # load must leave it a token anyway, and an async full hit would have vLLM recompute
        # the last token alone, which rounds differently from computing the block (same math,
        # other kernel tiling) - then a hit would not give exactly a recompute's logprobs.
        cap = (request.num_tokens - 1) // geo.block_size * geo.block_size
        end = min((first + local + remote) * geo.chunk_tokens, cap)
        tokens = max(0, end - computed)
        outcome.cpu_tokens = max(0, min(end, (first + local) * geo.chunk_tokens) - computed)
        self._count(C.LOOKUPS, 1)
        self._count(C.LOOKUP_TOKENS, request.num_tokens - computed)
        if tokens and tokens < self.config.min_hit_tokens.get("cpu", 0):
            self._count(C.CPU_SKIPPED_TOKENS, tokens)
            tokens = outcome.cpu_tokens = 0
        outcome.tokens = tokens
        if not tokens:
            self.release(outcome)
        return outcome

    def _lookup_local(
        self, ns_ids: dict[int, bytes], keys: dict[int, list[bytes]], outcome: LookupOutcome
    ) -> int:
        if "cpu" not in self.config.tiers:
            return 0
        for rank, ns_id in ns_ids.items():
            result = self.tier.lookup(ns_id, keys[rank], self.config.lease_ttl_s)
            if result.lease_id:
                outcome.lease_ids.append(result.lease_id)
            hits = result.hits
            if self.config.verify_loads:
                # A chunk whose checksum the store has not computed yet (it does so right
                # after the commit, off the writer's path) cannot be verified: the run ends
                # before it, so every chunk loaded is checked.
                hits = hits[: next((i for i, h in enumerate(hits) if not h.checksum), len(hits))]
            outcome.hits[rank] = hits
            outcome.epochs[rank] = result.epoch
        return min(len(h) for h in outcome.hits.values())

    def _pull_remote(
        self,
        ns_ids: dict[int, bytes],
        keys: dict[int, list[bytes]],
        local: int,
        outcome: LookupOutcome,
    ) -> int:
        """Pull the run after the local one from another node (every rank), lease it here.
        Returns the chunks added to ``outcome`` (0 when none, or not worth a round trip)."""
        assert self.remote is not None
        if local >= min(len(k) for k in keys.values()):
            return 0
        min_chunks = -(-self.config.min_hit_tokens.get("remote", 0) // self.geometry.chunk_tokens)
        pulled = []
        for rank, ns_id in ns_ids.items():
            run = self.remote.pull(ns_id, keys[rank][local:], max(1, min_chunks))
            pulled.append(run.chunks if run is not None else 0)
            if not pulled[-1]:
                return 0  # every rank needs the run
        n = min(pulled)
        for rank, ns_id in ns_ids.items():
            result = self.tier.lookup(ns_id, keys[rank][local : local + n], self.config.lease_ttl_s)
            if result.lease_id:
                outcome.lease_ids.append(result.lease_id)
            if local and outcome.epochs.get(rank, result.epoch) != result.epoch:
                return 0  # the store restarted between the two lookups: keep the local run
            outcome.hits[rank] = outcome.hits.get(rank, [])[:local] + result.hits
            outcome.epochs[rank] = result.epoch
            n = min(n, len(result.hits))  # evicted here already: keep what is leased
        self._count(C.REMOTE_PULLED_CHUNKS, n)
        return n

    # -- leases ------------------------------------------------------------------------------

    def release(self, outcome: LookupOutcome) -> None:
        """Give the outcome's leases back now (on the calling thread)."""
        self.release_ids(take_leases(outcome))

    def release_ids(self, lease_ids: list[int]) -> None:
        """Quiet: a lease the store no longer knows is already gone."""
        if not lease_ids:
            return
        try:
            self.tier.release(lease_ids)
        except KvtierError as exc:
            log.debug("kvtier: releasing %d leases: %s", len(lease_ids), exc)


def take_leases(outcome: LookupOutcome) -> list[int]:
    """Mark the outcome released and return the lease ids to give back (once; [] after)."""
    if outcome.released:
        return []
    outcome.released = True
    return list(outcome.lease_ids)


def _adapter_fingerprints():  # -> AdapterFingerprints (kept lazy: it reads adapter files)
    from kvtier.connector.fingerprint import AdapterFingerprints

    return AdapterFingerprints()
