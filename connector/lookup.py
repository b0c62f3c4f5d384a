"""The tier-first lookup of a request's prompt (``TierResolver.resolve``): how much the node
pool holds past vLLM's own hit, then how much more each staging tier (another node's pool,
the node's disk) can bring into the pool, all leased for the load; and the namespaces a
request's chunks live in. Every lease taken is handed to the outcome or released before
``resolve`` returns, also when it raises. What a request keeps between hooks:
``request_state.py``.

Threading: ``resolve`` runs on a ``kvtier-lookup`` thread (inline for an embedded store);
``known_miss`` on vLLM's scheduler thread.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtier.connector.counters import C, Counter, stage_counters
from kvtier.connector.fingerprint import AdapterFingerprints
from kvtier.connector.layout import KvGeometry, ModelIdentity
from kvtier.connector.request_state import LookupOutcome, RequestState, take_leases
from kvtier.core import engine_hint
from kvtier.core.chunks import ChunkLocation
from kvtier.core.config.connector import ConnectorConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, PromptKeyer
from kvtier.tiers import Tiers

if TYPE_CHECKING:
    from vllm.v1.request import Request

Count = Callable[[Counter, float], None]


# A known miss is decided on the scheduler thread only while the chunk it needs is among the
# prompt's first ones: hashing more (a long prefix vLLM already holds) is the lookup thread's.
INLINE_KEY_CHUNKS = 64
NAMESPACE_MEMO = 4096  # namespaces the resolver keeps built (one per salt and adapter in use)


class TierResolver:
    def __init__(
        self,
        config: ConnectorConfig,
        geometry: KvGeometry,
        identity_of: Callable[[], ModelIdentity],
        tiers: Tiers,
        count: Count,
    ) -> None:
        self.config = config
        self.geometry = geometry
        self._identity_of = identity_of
        self.pool = tiers.pool
        self.staging = tiers.staging
        self._count = count
        self._adapters = AdapterFingerprints()
        # (identity, rank, salt, adapter, attention only) -> namespace: built once, not per
        # request (~7 µs of pydantic on the scheduler thread for every known miss)
        self._namespace_memo: dict[tuple[ModelIdentity, int, str, str, bool], Namespace] = {}

    def namespaces(self, state: RequestState, attention_only: bool = False) -> dict[int, bytes]:
        """The request's namespace id per TP rank, registered with the store (by the pool, at
        most once per namespace). ``attention_only``: the sibling namespace of a model with
        state (``KvGeometry.has_state``), for chunks vLLM wrote no state for. Raises when the
        store is unreachable or refuses."""
        found = self._namespaces(state, register=True)
        if attention_only:
            found = self._namespaces(state, register=True, attention_only=True)
        assert found is not None
        return found

    def _namespaces(
        self, state: RequestState, register: bool, attention_only: bool = False
    ) -> dict[int, bytes] | None:
        """``register=False``: None unless the pool registered every one already (no call)."""
        cached = state.attention_ns_ids if attention_only else state.ns_ids
        if cached is not None:
            return cached
        identity = self._identity_of()
        lora_fp = self._adapters.of(state.lora_path) if state.lora_path else ""
        ns_ids = {}
        geo = self.geometry
        chunk_bytes = geo.attention_bytes if attention_only else geo.chunk_bytes
        for rank in identity.data_ranks(geo):
            namespace = self._namespace(identity, rank, state.salt, lora_fp, attention_only)
            if register:
                ns_ids[rank] = self.pool.namespace_id(namespace, chunk_bytes)
            elif (known := self.pool.registered_namespace_id(namespace, chunk_bytes)) is None:
                return None
            else:
                ns_ids[rank] = known
        with state.lock:
            if attention_only:
                state.attention_ns_ids = ns_ids
            elif state.ns_ids != ns_ids:  # the keys are the whole chunks' namespace's
                chunk = geo.chunk_tokens
                state.keyers = {r: PromptKeyer(ns, chunk) for r, ns in ns_ids.items()}
                state.ns_ids = ns_ids
        return ns_ids

    def _namespace(
        self, identity: ModelIdentity, rank: int, salt: str, lora_fp: str, attention_only: bool
    ) -> Namespace:
        memo_key = (identity, rank, salt, lora_fp, attention_only)
        found = self._namespace_memo.get(memo_key)
        if found is None:
            if len(self._namespace_memo) >= NAMESPACE_MEMO:  # many salts: start over
                self._namespace_memo.clear()
            found = identity.namespace(self.geometry, rank, salt, lora_fp, attention_only)
            self._namespace_memo[memo_key] = found
        return found

    def known_miss(self, state: RequestState, computed: int) -> LookupOutcome | None:
        """A lookup's outcome when it is known to find nothing without a round trip (on the
        scheduler thread: no lookup thread, no wait), else None: resolve it. Known whatever
        the tiers when no hit could be long enough (no whole chunk past vLLM's own hit: such a
        request must not wait in the lookup threads' queue behind slow pulls). Else known only
        where the pool is the one tier (a staging tier must be asked), the request's
        namespaces are registered already, its chunk past ``computed`` costs at most
        ``INLINE_KEY_CHUNKS`` chunks of hashing here, and the store's shared view says that
        chunk is absent on a rank (then no rank can load past it). The node's disk is the one
        staging tier the view can speak for (a store with the disk tier puts its files in the
        view too)."""
        geo = self.geometry
        first = computed // geo.chunk_tokens
        shortest = max(1, self.config.min_hit_tokens.get("cpu", 0))
        if self._hit_cap(state.request) - computed < shortest:
            # nothing any tier holds could be a hit (no whole chunk past vLLM's own hit, or
            # less than ``min_hit_tokens``): no lookup at all, so never queued behind slow ones
            return LookupOutcome(computed, first, session_generation=self.pool.session_generation)
        with_disk = any(tier.name == "disk" for tier in self.staging)
        # the view speaks for the node (pool and disk); another tier must be asked, unless
        # the router's word rules it out
        others = [tier for tier in self.staging if tier.name != "disk"]
        if "cpu" not in self.config.tiers or any(
            self._may_stage(tier, state, first) for tier in others
        ):
            return None
        if first >= state.request.num_tokens // geo.chunk_tokens or first >= INLINE_KEY_CHUNKS:
            return None
        ns_ids = self._namespaces(state, register=False)
        if ns_ids is None:
            return None
        attention_ids = None
        if geo.has_state:  # the chunk may be stored without its state, in the sibling
            attention_ids = self._namespaces(state, register=False, attention_only=True)
            if attention_ids is None:
                return None
        for rank, ns_id in ns_ids.items():
            keys = state.keys(rank, first + 1, geo.chunk_tokens)[first:]
            if self.pool.known_miss(ns_id, keys, with_disk) and (
                attention_ids is None or self.pool.known_miss(attention_ids[rank], keys, with_disk)
            ):
                self._count(C.LOOKUPS, 1)
                self._count(C.LOOKUPS_KNOWN_MISS, 1)
                if others:  # known only by the router's word
                    self._count(C.REMOTE_HINT_SKIPS, 1)
                self._count(C.LOOKUP_TOKENS, state.request.num_tokens - computed)
                generation = self.pool.session_generation
                return LookupOutcome(computed, first, session_generation=generation)
        return None

    def _may_stage(self, tier: Any, state: RequestState, from_chunk: int) -> bool:
        """Whether asking ``tier`` for the run after chunk ``from_chunk`` could give a hit.
        False for the remote tier when the router's word (``kvtier.core.engine_hint``, fresh
        enough) says no other node holds ``min_hit_tokens["remote"]`` (a chunk at least)
        past it: its index query is skipped, and a local miss is then known without a
        lookup thread (answered in the step, not a step later)."""
        max_age = self.config.router_hint_max_age_s
        if tier.name != "remote" or max_age <= 0:
            return True
        request = state.request
        elsewhere = engine_hint.elsewhere_tokens(request.kv_transfer_params)
        if elsewhere is None or time.time() - request.arrival_time > max_age:
            return True
        chunk = self.geometry.chunk_tokens
        worth = max(chunk, self.config.min_hit_tokens.get("remote", 0))
        return elsewhere >= from_chunk * chunk + worth

    def _hit_cap(self, request: Request) -> int:
        """Where any hit of ``request`` ends at the latest: its last whole chunk, and before
        its last block. vLLM computes the prompt's last block, as its own prefix cache has it:
        a sync load must leave it a token anyway, and an async full hit would have vLLM
        recompute the last token alone, which rounds differently from computing the block
        (same math, other kernel tiling) - then a hit would not give exactly a recompute's
        logprobs."""
        geo = self.geometry
        cap = (request.num_tokens - 1) // geo.block_size * geo.block_size
        if geo.hits_on_chunk_boundaries:  # a sliding window's blocks are kept per chunk end
            cap = cap // geo.chunk_tokens * geo.chunk_tokens
        return min(cap, request.num_tokens // geo.chunk_tokens * geo.chunk_tokens)

    def resolve(self, state: RequestState, computed: int) -> LookupOutcome:
        """Tier-first lookup for every TP rank: the pool's run (leased), then each staging
        tier's run after it, staged into the pool and leased there too."""
        geo = self.geometry
        request = state.request
        first = computed // geo.chunk_tokens
        total_chunks = request.num_tokens // geo.chunk_tokens
        outcome = LookupOutcome(computed, first, session_generation=self.pool.session_generation)
        if total_chunks <= first:
            return outcome
        ns_ids = self.namespaces(state)
        keys = {rank: state.keys(rank, total_chunks, geo.chunk_tokens)[first:] for rank in ns_ids}
        runs: list[tuple[str, int]] = []  # (tier, chunks) in order
        try:
            run = self._lookup_pool(state, ns_ids, keys, outcome)
            runs.append((self.pool.name, run))
            for tier in self.staging:
                if not self._may_stage(tier, state, first + run):
                    self._count(C.REMOTE_HINT_SKIPS, 1)
                    break
                more = self._stage_tier(tier, state, ns_ids, keys, run, outcome)
                if not more:
                    break
                runs.append((tier.name, more))
                run += more
        except KvtierError as exc:
            if exc.code is ErrorCode.UNKNOWN_NAMESPACE:  # the store forgot it: register anew
                for ns_id in [*ns_ids.values(), *(state.attention_ns_ids or {}).values()]:
                    self.pool.forget_namespace(ns_id)
                state.ns_ids = state.attention_ns_ids = None
            self.release(outcome)
            raise
        except BaseException:
            self.release(outcome)  # leases taken before the failure: give them back now
            raise
        if geo.has_state:  # capped first: the cut must land on a chunk the hit can end on
            capped = max(0, min(run, self._hit_cap(request) // geo.chunk_tokens - first))
            run = self._with_state_at_end(outcome, capped)
        end = min((first + run) * geo.chunk_tokens, self._hit_cap(request))
        tokens = max(0, end - computed)
        self._count(C.LOOKUPS, 1)
        self._count(C.LOOKUP_TOKENS, request.num_tokens - computed)
        if tokens and tokens < self.config.min_hit_tokens.get("cpu", 0):
            self._count(C.CPU_SKIPPED_TOKENS, tokens)
            tokens = 0
        outcome.tokens = tokens
        position = first * geo.chunk_tokens
        for name, chunks in runs:  # which tier each loaded token came from
            upto = min(position + chunks * geo.chunk_tokens, computed + tokens)
            if upto > max(position, computed):
                outcome.sources[name] = upto - max(position, computed)
            position += chunks * geo.chunk_tokens
        if not tokens:
            self.release(outcome)
        return outcome

    def _lookup_pool(
        self,
        state: RequestState,
        ns_ids: dict[int, bytes],
        keys: dict[int, list[bytes]],
        outcome: LookupOutcome,
    ) -> int:
        if "cpu" not in self.config.tiers:
            return 0
        if self.geometry.has_state:
            attention_ids = self.namespaces(state, attention_only=True)
            for rank, ns_id in ns_ids.items():
                self._lookup_with_state(rank, (ns_id, attention_ids[rank]), keys[rank], outcome)
            return min(len(h) for h in outcome.hits.values())
        for rank, ns_id in ns_ids.items():
            result = self.pool.lookup(ns_id, keys[rank], self.config.load_lease_ttl_s)
            if result.lease_id:
                outcome.lease_ids.append(result.lease_id)
                outcome.granted(result.lease_ttl_s or self.config.load_lease_ttl_s)
            outcome.hits[rank] = self._verifiable(result.hits)
            outcome.epochs[rank] = result.epoch
        return min(len(h) for h in outcome.hits.values())

    def _lookup_with_state(
        self, rank: int, namespaces: tuple[bytes, bytes], keys: list[bytes], outcome: LookupOutcome
    ) -> None:
        """A model with state: the run of chunks held whole (``namespaces[0]``) or as their
        attention alone (``namespaces[1]``), in any mix, leased. Each lookup answers the run
        of one namespace from where the run got to, so the two take turns until neither
        continues it. Where the hit may end is ``_with_state_at_end``'s business."""
        hits: list[ChunkLocation] = []
        turn, fruitless = 0, 0
        while len(hits) < len(keys) and fruitless < 2:
            result = self.pool.lookup(
                namespaces[turn], keys[len(hits) :], self.config.load_lease_ttl_s
            )
            if result.lease_id:
                outcome.lease_ids.append(result.lease_id)
                outcome.granted(result.lease_ttl_s or self.config.load_lease_ttl_s)
            if outcome.epochs.setdefault(rank, result.epoch) != result.epoch:
                break  # the store restarted between two lookups: keep the first run
            got = self._verifiable(result.hits)
            hits += got
            fruitless = 0 if got else fruitless + 1
            turn ^= 1
        outcome.hits[rank] = hits

    def _with_state_at_end(self, outcome: LookupOutcome, run: int) -> int:
        """A model with state: a hit ends on a chunk stored whole on every rank (its state is
        what vLLM continues from); the chunks before it may be attention alone. Returns the
        run cut back to the last such chunk (the leases of the chunks cut stay with the
        outcome, released with it)."""
        whole = self.geometry.chunk_bytes
        while run and any(hits[run - 1].size != whole for hits in outcome.hits.values()):
            run -= 1
        for rank, hits in outcome.hits.items():
            outcome.hits[rank] = hits[:run]
        return run

    def _stage_tier(
        self,
        tier: Any,
        state: RequestState,
        ns_ids: dict[int, bytes],
        keys: dict[int, list[bytes]],
        run: int,
        outcome: LookupOutcome,
    ) -> int:
        """The chunks ``tier`` adds to the run after ``run``: for a model with state, staged
        from the whole chunks' and the attention-alone namespaces in turn (as
        ``_lookup_with_state``) until neither continues it; the hit's end is cut back to a
        whole chunk afterwards (``_with_state_at_end``). Only the first stage of all must be
        worth ``min_hit_tokens``: past it the run is long enough."""
        if not self.geometry.has_state:
            return self._stage_rounds(tier, ns_ids, keys, run, outcome)
        namespaces = (ns_ids, self.namespaces(state, attention_only=True))
        total, turn, fruitless = 0, 0, 0
        while fruitless < 2:
            more = self._stage_rounds(tier, namespaces[turn], keys, run + total, outcome, not total)
            total += more
            fruitless = 0 if more else fruitless + 1
            turn ^= 1
        return total

    def _stage_rounds(
        self,
        tier: Any,
        ns_ids: dict[int, bytes],
        keys: dict[int, list[bytes]],
        run: int,
        outcome: LookupOutcome,
        first: bool = True,
    ) -> int:
        """``_stage``, again for the rest while a tier that stages in rounds
        (``StagingTier.stages_in_rounds``: the node's disk, whose store allocates at most
        ``store.max_batch_fraction`` of its pool per stage) makes progress: each round is
        leased before the next one allocates, so a later round cannot evict an earlier one.
        Without this a disk hit longer than that share of the pool was cut there and the
        rest recomputed. Returns the chunks added to ``outcome``."""
        total = 0  # ``_stage`` answers 0 once the run reaches the prompt's end
        while more := self._stage(tier, ns_ids, keys, run + total, outcome, first and not total):
            total += more
            if not tier.stages_in_rounds:
                break
        return total

    def _stage(
        self,
        tier: Any,
        ns_ids: dict[int, bytes],
        keys: dict[int, list[bytes]],
        run: int,
        outcome: LookupOutcome,
        first_round: bool = True,
    ) -> int:
        """Stage the run after ``run`` chunks from ``tier`` into the pool (every rank), lease
        it there. Returns the chunks added to ``outcome`` (0: none, or not worth it). Past
        the first round the run is already long enough for ``min_hit_tokens``."""
        if run >= min(len(k) for k in keys.values()):
            return 0
        min_chunks = -(-self.config.min_hit_tokens.get(tier.name, 0) // self.geometry.chunk_tokens)
        if not first_round:
            min_chunks = 1
        staged = []
        for rank, ns_id in ns_ids.items():
            result = tier.stage(ns_id, keys[rank][run:], max(1, min_chunks))
            for counter, value in stage_counters(tier.name, result):
                self._count(counter, value)
            staged.append(result.chunks)
            if not result.chunks:
                return 0  # every rank needs the run
        n = min(staged)
        for rank, ns_id in ns_ids.items():
            result = self.pool.lookup(
                ns_id, keys[rank][run : run + n], self.config.load_lease_ttl_s
            )
            if result.lease_id:
                outcome.lease_ids.append(result.lease_id)
                outcome.granted(result.lease_ttl_s or self.config.load_lease_ttl_s)
            if run and outcome.epochs.get(rank, result.epoch) != result.epoch:
                return 0  # the store restarted between the two lookups: keep the first run
            hits = self._verifiable(result.hits)
            outcome.hits[rank] = outcome.hits.get(rank, [])[:run] + hits
            outcome.epochs[rank] = result.epoch
            n = min(n, len(hits))  # evicted already, or unverifiable: keep what is leased
        return n

    def _verifiable(self, hits: list[ChunkLocation]) -> list[ChunkLocation]:
        """With ``verify_loads``, the run ends before the first chunk whose checksum the
        store has not computed yet (it does so right after a commit, off the writer's path):
        every chunk loaded is checked, whichever tier brought it into the pool."""
        if not self.config.verify_loads:
            return hits
        return hits[: next((i for i, h in enumerate(hits) if not h.checksum), len(hits))]

    # -- leases ------------------------------------------------------------------------------

    def release(self, outcome: LookupOutcome) -> None:
        """Give the outcome's leases back now (on the calling thread)."""
        self.release_ids(take_leases(outcome))

    def release_ids(self, lease_ids: list[int]) -> None:
        """Quiet: a lease the store no longer knows is already gone."""
        if not lease_ids:
            return
        with contextlib.suppress(KvtierError):
            self.pool.release(lease_ids)
