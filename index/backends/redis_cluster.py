"""Chunk index on Redis Cluster: shards by namespace, one prompt's query on one master.

The index is ``shards`` complete ``RedisIndex`` instances, shard ``s`` under the prefix
``<prefix>{<tag s>}:``: the hash tag puts every key of a shard in one slot, so each shard's Lua
scripts run unchanged and atomically on the master that serves it (``redis_shard``), and the
tags spread the shards evenly over the slot space, so over the masters.

- **Placement** (``placement``). ``namespace`` (the default): a namespace's chunks live in one
  shard (``shard_of``: its id, a hash, modulo ``shards``), so a prompt's query is one script
  call on one master, as on a single Redis. A fleet's load spreads over masters by namespace
  (models, dtypes, adapters, tenants' salts); a fleet serving one namespace keeps its chunks on
  one master. ``chunk``: each chunk lives in the shard of its key (a hash, so uniform), so one
  namespace's writes spread over every master; a prompt's query asks every shard that holds
  one of its chunks for those chunks, in order, and the answers combine (``combine_answers``):
  a location's run ends at the first chunk any shard says it lacks. The price: a query costs a
  call per shard it touches, and any shard being down degrades every prompt's answer, not
  only its namespaces' (docs/index.md measures both).
- **Metadata in every shard.** Every shard holds every namespace and every location (its
  status, cursor, last heartbeat), written to all shards in turn, so each shard checks a
  batch's cursor by itself. An ``apply`` goes to the shards its ops touch, and the answers
  combine: RESYNC if any shard lost the cursor, else APPLIED if any applied, else DUPLICATE.
  A shard a batch does not touch is skipped, and its cursor lags: the next batch that touches
  it starts (``seq_from``) just after the last one it took, so its gap check still means
  "nothing of mine was lost". That needs this process to have seen every batch in between:
  a batch whose ``seq_from`` does not follow this process's last one for the location (a
  first batch, a gap, another replica's batches), or any error, sends the next batch to
  every shard with the writer's own ``seq_from``; so does every batch after a shard was reset
  (its cursors went down with it). A location's cursor is the least of its
  shards' (where a writer may resume from). A batch that failed half-way is resent or
  resynced by its writer: every op is idempotent and a shard that took it answers DUPLICATE.
  A bad batch is refused before any shard sees it.
- **Failover and resharding.** A shard that another node starts serving (a replica promoted by
  a failover, or the slot's new owner after a reshard) is a reset of that shard: its locations
  are taken down before it answers again, and the writers resync (``redis_watch``). Until the
  promoted node answers, the shard's queries answer DEGRADED and its writes UNAVAILABLE; no
  answer ever comes from a node the backend has not checked.
- **Claims** of a location's writer live in shard 0.

Threading: thread-safe (each shard is; the per-location record of which batch each shard
took is guarded by a lock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, get_args

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from kvtier.core.chunks import Tier
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace
from kvtier.index.api import (
    ApplyStatus,
    BackendResets,
    ChunkIndex,
    ChunkOp,
    HeartbeatStatus,
    Holding,
    IndexHealth,
    LocationInfo,
    LocationStatus,
    Query,
    QueryResult,
    Registration,
)
from kvtier.index.backends.redis import RedisIndex
from kvtier.index.backends.redis_shard import ShardClient, shard_tags
from kvtier.index.rules import (
    check_holdings,
    check_ops,
    check_seq_range,
    order_holdings,
    resolve_keys,
)
from kvtier.store.api.events import EventKind

Placement = Literal["namespace", "chunk"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)

_STATUS_RANK = {  # a location's heartbeat answer across shards: the most urgent wins
    HeartbeatStatus.OK: 0,
    HeartbeatStatus.RESYNC: 1,
    HeartbeatStatus.UNKNOWN: 2,
}


@dataclass
class _Taken:
    """What this process knows its shards took of one location's stream."""

    epoch: int
    last: int  # the seq_to of the newest batch this process applied for the location
    by_shard: list[int]  # the newest seq each shard took (its cursor there)


class RedisClusterIndex(ChunkIndex):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:7000/0",
        prefix: str = "kvtier:index:",
        timeout_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        max_namespaces: int | None = None,
        max_claim_ttl_s: float | None = None,
        shards: int = 6,
        placement: Placement = "namespace",
    ) -> None:
        """``url``: any node of the cluster (the others are discovered). ``shards``: how many
        parts the index is cut into, ``placement``: by what a chunk's shard is chosen (see the
        module docstring); every process sharing ``prefix`` must use the same of both
        (checked: a mismatch is refused, it would look for chunks in the wrong shard)."""
        if not 1 <= shards <= 1024:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"shards must be 1..1024, not {shards}")
        if placement not in PLACEMENTS:
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT, f"placement is one of {PLACEMENTS}, not {placement!r}"
            )
        self.placement = placement
        self.url, self.prefix = url, prefix
        try:  # redis-py learns the slot map here: the cluster must answer at start
            self._cluster = RedisCluster.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                decode_responses=False,
            )
        except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            raise KvtierError(
                ErrorCode.UNAVAILABLE,
                f"redis cluster {url}: no slot map at start ({exc}); give a node that answers",
            ) from None
        self._shards: list[RedisIndex] = []
        tags = shard_tags(shards)
        for i, tag in enumerate(tags):
            shard_prefix = f"{prefix}{{{tag}}}:"
            self._shards.append(
                RedisIndex(
                    f"{url} shard {i}",  # in messages: which shard
                    shard_prefix,
                    timeout_s,
                    clock,
                    max_namespaces=max_namespaces if i == 0 else None,  # shard 0 decides
                    max_claim_ttl_s=max_claim_ttl_s,
                    shard=ShardClient(self._cluster, key_slot(shard_prefix.encode())),
                )
            )
        self._layout_key = f"{prefix}{{{tags[0]}}}:shards".encode()
        self._layout_checked = False
        self._lock = threading.Lock()
        self._taken: dict[str, _Taken] = {}
        self._resets_seen = 0
        self._pool: ThreadPoolExecutor | None = None  # placement chunk's queries, on first use

    # -- plumbing -----------------------------------------------------------------------------

    def shard_of(self, ns_id: bytes, key: bytes = b"") -> int:
        """The shard holding a chunk: its namespace's (placement ``namespace``) or its key's
        (``chunk``); both are hashes, so uniform."""
        if self.placement == "chunk" and key:
            return int.from_bytes(key[:8], "big") % len(self._shards)
        return int.from_bytes(ns_id[:8], "big") % len(self._shards)

    def _split_keys(self, ns_id: bytes, keys: Sequence[bytes]) -> dict[int, list[int]]:
        """Shard -> the positions in ``keys`` of the chunks it holds, in order."""
        out: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            out.setdefault(self.shard_of(ns_id, key), []).append(i)
        return out

    def _check_layout(self) -> None:
        """Refuse a cluster whose index was cut into another number of shards, or placed by
        something else."""
        if self._layout_checked:
            return
        shard0 = self._shards[0]
        want = str(len(self._shards)).encode()
        if self.placement != "namespace":  # the namespace layout's value, as before it had any
            want += f"/{self.placement}".encode()
        have = shard0._call(shard0._r.set, self._layout_key, want, nx=True, get=True)
        if have is not None and have != want:
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT,
                f"the index under this prefix is cut into {have.decode()} shards (/placement), "
                f"this process {want.decode()}: every index process must use the same "
                "index.redis_shards and index.redis_placement",
            )
        self._layout_checked = True

    def _by_shard(self, ops: Sequence[ChunkOp]) -> list[list[ChunkOp]]:
        """Each shard's share of ``ops``, in order; a CLEARED (no namespace) goes to all."""
        out: list[list[ChunkOp]] = [[] for _ in self._shards]
        for op in ops:
            if op.kind is EventKind.CLEARED or (self.placement == "chunk" and not op.keys):
                for share in out:
                    share.append(op)
            elif self.placement == "chunk":
                for shard, positions in self._split_keys(op.ns_id, op.keys).items():
                    keys = tuple(op.keys[i] for i in positions)
                    out[shard].append(ChunkOp(op.kind, op.tier, op.ns_id, keys))
            else:
                out[self.shard_of(op.ns_id)].append(op)
        return out

    # -- namespaces and locations -------------------------------------------------------------

    def register_namespace(self, namespace: Namespace | bytes) -> bytes:
        self._check_layout()
        ns_id = self._shards[0].register_namespace(namespace)  # the bound is shard 0's
        for shard in self._shards[1:]:
            shard.register_namespace(namespace)
        return ns_id

    def namespaces(self) -> dict[bytes, Namespace | None]:
        return self._shards[0].namespaces()

    def namespace(self, ns_id: bytes) -> tuple[bool, Namespace | None]:
        return self._shards[0].namespace(ns_id)

    def register(self, registration: Registration) -> LocationInfo:
        self._check_layout()
        for shard in self._shards:
            shard.register(registration)
        info = self.location(registration.location)
        assert info is not None
        return info

    def unregister(self, location: str) -> bool:
        return any([shard.unregister(location) for shard in self._shards])

    def location(self, name: str) -> LocationInfo | None:
        infos = [shard.location(name) for shard in self._shards]
        if any(info is None for info in infos):
            return None  # registration not finished on every shard (or undone)
        parts = [info for info in infos if info is not None]
        first = parts[0]
        down = any(info.status is LocationStatus.DOWN for info in parts)
        entries = {tier: sum(info.entries.get(tier, 0) for info in parts) for tier in first.entries}
        return LocationInfo(
            first.registration,
            LocationStatus.DOWN if down else LocationStatus.UP,
            max(info.last_seen for info in parts),
            min((info.cursor for info in parts), key=lambda c: (c.epoch, c.seq)),
            entries,
        )

    def locations(self) -> list[LocationInfo]:
        names = [info.registration.location for info in self._shards[0].locations()]
        return [info for name in names if (info := self.location(name)) is not None]

    def heartbeat(self, locations: Sequence[str]) -> list[HeartbeatStatus]:
        combined = [HeartbeatStatus.OK] * len(locations)
        for shard in self._shards:
            for i, status in enumerate(shard.heartbeat(locations)):
                if _STATUS_RANK[status] > _STATUS_RANK[combined[i]]:
                    combined[i] = status
        return combined

    def drop(self, location: str) -> bool:
        return any([shard.drop(location) for shard in self._shards])

    def reap(self, timeout_s: float) -> list[str]:
        dropped: dict[str, None] = {}
        for shard in self._shards:
            dropped.update(dict.fromkeys(shard.reap(timeout_s)))
        return list(dropped)

    def claim(self, location: str, owner: str, ttl_s: float) -> bool:
        return self._shards[0].claim(location, owner, ttl_s)

    # -- writes -------------------------------------------------------------------------------

    def apply(
        self,
        location: str,
        ops: Sequence[ChunkOp],
        *,
        epoch: int = 0,
        seq_from: int = 0,
        seq_to: int = 0,
    ) -> ApplyStatus:
        known = {op.ns_id: None for op in ops if op.ns_id and self.namespace(op.ns_id)[0]}
        check_ops(ops, known)  # a bad batch reaches no shard
        check_seq_range(seq_from, seq_to)
        shares = self._by_shard(ops)
        resets = self.backend_resets().resets
        with self._lock:
            if resets != self._resets_seen:  # a shard was reset: its cursors went down
                self._taken.clear()
                self._resets_seen = resets
            taken = self._taken.pop(location, None)  # back only once every shard answered
        follows = (
            taken is not None and seq_to > 0 and taken.epoch == epoch and seq_from == taken.last + 1
        )
        unsequenced = seq_to == 0  # no cursor moves: only the shards with ops (and shard 0)
        statuses = []
        for s, (shard, share) in enumerate(zip(self._shards, shares, strict=True)):
            if (follows or unsequenced) and not share and not (unsequenced and s == 0):
                continue  # nothing for this shard: its cursor lags, see the module docstring
            first = taken.by_shard[s] + 1 if follows and taken is not None else seq_from
            statuses.append(
                shard.apply(location, share, epoch=epoch, seq_from=first, seq_to=seq_to)
            )
        if ApplyStatus.RESYNC in statuses:
            return ApplyStatus.RESYNC
        if unsequenced or (statuses and ApplyStatus.APPLIED not in statuses):
            if taken is not None:  # cursors unchanged (no cursor, or a batch replayed)
                with self._lock:
                    self._taken.setdefault(location, taken)
            return ApplyStatus.APPLIED if unsequenced else ApplyStatus.DUPLICATE
        by_shard = taken.by_shard if follows and taken is not None else [0] * len(shares)
        for s, share in enumerate(shares):
            if share or not follows:
                by_shard[s] = max(by_shard[s], seq_to)
        with self._lock:
            self._taken[location] = _Taken(epoch, seq_to, by_shard)
        return ApplyStatus.APPLIED

    def replace(
        self,
        location: str,
        holdings: Mapping[Tier, Mapping[bytes, Sequence[bytes]]],
        *,
        epoch: int,
        seq: int,
    ) -> None:
        known = {ns: None for by_ns in holdings.values() for ns in by_ns if self.namespace(ns)[0]}
        check_holdings(holdings, known)
        shares: list[dict[Tier, dict[bytes, Sequence[bytes]]]] = [{} for _ in self._shards]
        for tier, by_ns in holdings.items():
            for ns_id, keys in by_ns.items():
                for s, positions in self._split_keys(ns_id, keys).items():
                    shares[s].setdefault(tier, {})[ns_id] = [keys[i] for i in positions]
        with self._lock:
            self._taken.pop(location, None)
        for shard, share in zip(self._shards, shares, strict=True):
            shard.replace(location, share, epoch=epoch, seq=seq)  # every shard: its cursor
        if seq > 0:
            with self._lock:
                self._taken[location] = _Taken(epoch, seq, [seq] * len(self._shards))

    # -- reads --------------------------------------------------------------------------------

    def query(self, queries: Sequence[Query]) -> list[QueryResult]:
        if self.placement == "chunk":
            return self._query_spread(queries)
        by_shard: dict[int, list[int]] = {}
        for i, q in enumerate(queries):
            by_shard.setdefault(self.shard_of(q.ns_id), []).append(i)
        out: list[QueryResult | None] = [None] * len(queries)
        for s, positions in by_shard.items():
            answers = self._shards[s].query([queries[i] for i in positions])
            for i, answer in zip(positions, answers, strict=True):
                out[i] = answer
        return [answer for answer in out if answer is not None]

    def _query_spread(self, queries: Sequence[Query]) -> list[QueryResult]:
        """Placement ``chunk``: each prompt's chunks asked of the shards that hold them (one
        call per shard for every prompt's share), the answers combined prompt by prompt."""
        asked: dict[int, list[Query]] = {}  # shard -> its sub-queries, in order
        parts: list[list[tuple[int, int, list[int]]]] = []  # per query: (shard, #, positions)
        sizes: list[int] = []
        for q in queries:
            try:
                known, namespace = self.namespace(q.ns_id)
            except KvtierError as exc:  # shard 0, which keeps the definitions, is down
                if exc.code is not ErrorCode.UNAVAILABLE:
                    raise
                return [QueryResult(q.ns_id, 0, (), IndexHealth.DEGRADED) for q in queries]
            keys = resolve_keys(q, {q.ns_id: namespace} if known else {})
            sizes.append(len(keys))
            mine = []
            for shard, positions in self._split_keys(q.ns_id, keys).items():
                sub = asked.setdefault(shard, [])
                mine.append((shard, len(sub), positions))
                sub.append(Query(q.ns_id, keys=[keys[i] for i in positions]))
            parts.append(mine)
        answers = dict(zip(asked, self._fan_out(asked), strict=True))
        return [
            combine_answers(
                q.ns_id, n, [(positions, answers[shard][i]) for shard, i, positions in mine]
            )
            for q, n, mine in zip(queries, sizes, parts, strict=True)
        ]

    def _fan_out(self, asked: dict[int, list[Query]]) -> list[list[QueryResult]]:
        """Each shard's share of the queries, the shards asked side by side (their round trips
        overlap; the answers come back in ``asked``'s order)."""
        if len(asked) == 1:
            ((shard, subs),) = asked.items()
            return [self._shards[shard].query(subs)]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(len(self._shards), "kvtier-index-shard")
        futures = [self._pool.submit(self._shards[s].query, subs) for s, subs in asked.items()]
        return [future.result() for future in futures]

    def stats(self) -> dict[str, int | float | str]:
        out: dict[str, int | float | str] = dict(self._shards[0].stats())
        for shard in self._shards[1:]:
            for name, value in shard.stats().items():
                if name.startswith("entries_") and isinstance(value, int):
                    out[name] = int(out[name]) + value
        out["backend"] = "redis-cluster"
        out["shards"] = len(self._shards)
        out["placement"] = self.placement
        return out

    def health(self) -> tuple[IndexHealth, str]:
        """DEGRADED while any shard is unreachable or resyncing (its prompts answer empty)."""
        reasons = []
        for i, shard in enumerate(self._shards):
            state, reason = shard.health()
            if state is not IndexHealth.OK:
                reasons.append(f"shard {i}: {reason}")
        if not reasons:
            try:
                self._check_layout()
            except KvtierError as exc:
                return IndexHealth.DEGRADED, exc.message
            return IndexHealth.OK, f"redis cluster {self.url}, {len(self._shards)} shards"
        return IndexHealth.DEGRADED, "; ".join(reasons)

    def backend_resets(self) -> BackendResets:
        parts = [shard.backend_resets() for shard in self._shards]
        reasons = [p.reason for p in parts if p.reason]
        return BackendResets(
            sum(p.resets for p in parts),
            sum(p.restarts for p in parts),
            reasons[-1] if reasons else "",
            any(p.recovering for p in parts),
        )

    def flush(self) -> int:
        """Delete every key of every shard (tests, benchmarks). Returns how many."""
        n = sum(shard.flush() for shard in self._shards)
        n += self._shards[0]._r.delete(self._layout_key)
        self._layout_checked = False
        return n

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._cluster.close()


def combine_answers(
    ns_id: bytes, num_chunks: int, parts: Sequence[tuple[Sequence[int], QueryResult]]
) -> QueryResult:
    """One prompt's answer from its shards' (placement ``chunk``): ``parts`` pairs the
    positions in the prompt of the chunks a shard was asked about, in order, with its answer
    for them. A run a shard reports over its chunks ends, in the prompt, at the position of
    the first chunk it lacks; a location's run is the shortest of those (a shard that does not
    name it lacks its first chunk). Any shard not answering (DEGRADED) degrades the whole
    answer: a run it would have cut short cannot be reported. ``stored_at`` is the newest of
    the shards' (each the time of its own run's last chunk): a freshness hint, not a place."""
    if any(answer.health is not IndexHealth.OK for _, answer in parts):
        return QueryResult(ns_id, num_chunks, (), IndexHealth.DEGRADED)

    def end(positions: Sequence[int], run: int) -> int:
        return positions[run] if run < len(positions) else num_chunks

    found: dict[str, list[Holding]] = {}
    for _, answer in parts:
        for holding in answer.holdings:
            found.setdefault(holding.location, []).append(holding)
    combined = []
    for name, held in found.items():
        by_shard = [(positions, answer.of(name)) for positions, answer in parts]
        total = min(end(p, h.total if h else 0) for p, h in by_shard)
        if not total:
            continue
        tiers = {tier for h in held for tier in h.runs}
        runs = {t: min(end(p, h.runs.get(t, 0) if h else 0) for p, h in by_shard) for t in tiers}
        first = held[0]
        combined.append(
            Holding(
                name,
                first.kind,
                first.node,
                {tier: run for tier, run in runs.items() if run},
                total,
                max(h.last_seen for h in held),
                max(h.stored_at for h in held),
            )
        )
    return QueryResult(ns_id, num_chunks, order_holdings(combined))
