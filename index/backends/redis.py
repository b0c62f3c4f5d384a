"""Chunk index in Redis: several index replicas share it, and it outlives an index restart.

Same model as ``MemoryIndex`` (slots, holder bitmaps, per-slot entry hashes; see
``redis_lua`` for the layout); every write and every query is one Lua script, so a query is
one round trip and a write is atomic. A batch of queries is one pipeline. ``redis_codec``
builds the scripts' arguments and reads their answers; this module calls them.

When Redis is unreachable, queries answer empty with ``IndexHealth.DEGRADED`` and writes raise
UNAVAILABLE; nothing crashes, and writers resync once it is back (their next ``apply`` sees a
gap or an unknown location and they ``replace``).

When Redis comes back *without its data* (restarted without persistence, flushed), cursors
cannot tell: ``backend_watch.GenerationWatch`` notices (on every health check, and when a
write finds its namespace or location gone), this backend writes back the namespaces and the
locations it registered, and ``backend_resets()`` tells this process's writers to send their
whole state again.

Threading: thread-safe (redis-py's connection pool); the caches of namespaces and location
registrations are guarded by a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis

from kvtier.core.chunks import Tier
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import KEY_BYTES, Namespace
from kvtier.index.api import (
    INDEX_TIERS,
    TIER_BITS,
    ApplyStatus,
    BackendResets,
    ChunkIndex,
    ChunkOp,
    HeartbeatStatus,
    IndexHealth,
    LocationInfo,
    LocationStatus,
    Query,
    QueryResult,
    Registration,
)
from kvtier.index.backends import redis_lua
from kvtier.index.backends.redis_codec import (
    LOC_FIELDS,
    apply_args,
    holdings_from_reply,
    location_info,
    reg_from_json,
    reg_to_json,
)
from kvtier.index.backends.redis_shard import ShardClient
from kvtier.index.backends.redis_watch import GenerationWatch
from kvtier.index.rules import (
    check_holdings,
    check_ops,
    check_registration,
    check_seq_range,
    resolve_keys,
    too_many_namespaces,
    unknown_location,
    unserved_namespace,
)
from kvtier.store.api.events import EventKind

log = logging.getLogger(__name__)

_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
REPLACE_BATCH = 8192  # keys per script call while replacing (bounds how long Redis is busy)


class RedisIndex(ChunkIndex):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "kvtier:index:",
        timeout_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        max_namespaces: int | None = None,
        max_claim_ttl_s: float | None = None,
        shard: ShardClient | None = None,
    ) -> None:
        """``max_namespaces``: refuse a new namespace past this many (None: no bound).
        ``max_claim_ttl_s``: the longest any claim lasts without renewal (None: as asked).
        ``shard``: this index is one shard of ``RedisClusterIndex``, on the node serving that
        client's slot (``prefix`` carries the slot's hash tag); see ``redis_shard``."""
        self.url = url
        self._max_ns = max_namespaces or 0
        self._max_claim_ms = int(max_claim_ttl_s * 1000) if max_claim_ttl_s else 0
        self._p = prefix.encode()
        self._clock = clock
        self._r: Any = shard or redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=False,
        )
        self._shard = shard
        self._apply = self._r.register_script(redis_lua.APPLY)
        self._begin_replace = self._r.register_script(redis_lua.BEGIN_REPLACE)
        self._register = self._r.register_script(redis_lua.REGISTER)
        self._drop = self._r.register_script(redis_lua.DROP)
        self._heartbeat = self._r.register_script(redis_lua.HEARTBEAT)
        self._claim = self._r.register_script(redis_lua.CLAIM)
        self._register_ns = self._r.register_script(redis_lua.REGISTER_NS)
        self._query_script = self._r.register_script(redis_lua.QUERY)
        self._lock = threading.Lock()
        self._ns: dict[bytes, Namespace | None] = {}
        self._regs: dict[str, Registration] = {}
        self._own: set[str] = set()  # locations registered through this process
        self._down_reason = ""
        where = shard.node_name if shard is not None else None
        self._watch = GenerationWatch(self._r, self._p + b"generation", url, self._recover, where)

    # -- plumbing -----------------------------------------------------------------------------

    def _loc_key(self, name: str) -> bytes:
        return self._p + b"loc:" + name.encode()

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            if self._watch.generation is None:  # first contact: adopt before writing
                self._watch.establish()
            elif self._watch.moved():  # a cluster shard on another node: reset it first
                self._watch.check()
            result = fn(*args, **kwargs)
            if self._watch.moved():  # answered by a node not checked yet: not trusted
                raise redis.ConnectionError("the shard moved to another node during the call")
        except _REDIS_DOWN as exc:
            self._down_reason = f"redis {self.url} unreachable: {exc}"
            raise KvtierError(ErrorCode.UNAVAILABLE, self._down_reason) from None
        except redis.ResponseError as exc:
            raise KvtierError(ErrorCode.INTERNAL, f"redis: {exc}") from None
        self._down_reason = ""
        return result

    def _suspect(self) -> None:
        """A write found its namespace or location gone: Redis may have lost its data. Check
        now rather than at the next health check, so that writers resync at once."""
        try:
            self._call(self._watch.check)
        except KvtierError as exc:
            log.debug("redis generation check: %s", exc)

    def _recover(self) -> None:
        """After a reset. On a cluster shard that another node now serves, first take every
        location's entries down (status down, cursor cleared): the node may lack the newest
        writes, removals among them, and answers must not name a holder that dropped a chunk.
        Their writers' next apply or heartbeat answers RESYNC."""
        if self._shard is not None:
            names = self._r.hkeys(self._p + b"locs")
            for name in names:
                self._drop(keys=[self._loc_key(name.decode())], args=[self._p, name, "0", ""])
        self._rewrite()

    def _rewrite(self) -> None:
        """After a reset: write back every namespace this process knows and every location
        it registered (not those it only read: their registrants, maybe other replicas, write
        them back; a stale copy of ours would resurrect one unregistered meanwhile). The
        locations come back UP with an empty cursor, so their writers' next ``apply`` answers
        RESYNC even if they missed the reset."""
        with self._lock:
            namespaces = dict(self._ns)
            regs = [self._regs[name] for name in sorted(self._own) if name in self._regs]
        pipe = self._r.pipeline(transaction=False)
        for ns_id, namespace in namespaces.items():
            if namespace is not None:
                pipe.hset(self._p + b"ns", ns_id, namespace.model_dump_json())
        for ns_id in dict.fromkeys([*namespaces, *(n for r in regs for n in r.namespaces)]):
            pipe.hsetnx(self._p + b"ns", ns_id, b"")
        now = repr(self._clock())
        for reg in regs:
            args: list[Any] = [self._p, reg.location, reg_to_json(reg), now, *reg.namespaces]
            self._register(keys=[self._loc_key(reg.location)], args=args, client=pipe)
        self._call(pipe.execute)

    def _namespace(self, ns_id: bytes) -> tuple[bool, Namespace | None]:
        """(known, definition), from the cache or Redis. Definitions never change (the id is
        their hash) but an id-only namespace may gain its definition later."""
        with self._lock:
            if self._ns.get(ns_id) is not None:
                return True, self._ns[ns_id]
        raw = self._call(self._r.hget, self._p + b"ns", ns_id)
        if raw is None:
            return False, None
        namespace = Namespace.model_validate_json(raw) if raw else None
        with self._lock:
            self._ns[ns_id] = namespace
        return True, namespace

    # -- namespaces and locations -------------------------------------------------------------

    def register_namespace(self, namespace: Namespace | bytes) -> bytes:
        definition: Namespace | None = None
        if isinstance(namespace, Namespace):
            ns_id, definition = namespace.root_key(), namespace
        elif not isinstance(namespace, bytes) or len(namespace) != KEY_BYTES:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "a namespace id is 16 bytes")
        else:
            ns_id = namespace
        # one script: the bound holds across replicas sharing this Redis
        text = definition.model_dump_json() if definition is not None else ""
        args = [ns_id, text, self._max_ns]
        if not self._call(self._register_ns, keys=[self._p + b"ns"], args=args):
            raise too_many_namespaces(self._max_ns)
        with self._lock:
            if definition is not None:
                self._ns[ns_id] = definition
            else:
                self._ns.setdefault(ns_id, None)  # known: written back after a reset
        return ns_id

    def namespaces(self) -> dict[bytes, Namespace | None]:
        raw = self._call(self._r.hgetall, self._p + b"ns")
        out = {ns: (Namespace.model_validate_json(v) if v else None) for ns, v in raw.items()}
        with self._lock:
            self._ns.update(out)
        return out

    def namespace(self, ns_id: bytes) -> tuple[bool, Namespace | None]:
        return self._namespace(ns_id)

    def register(self, registration: Registration) -> LocationInfo:
        check_registration(registration)
        result = self._call(
            self._register,
            keys=[self._loc_key(registration.location)],
            args=[
                self._p,
                registration.location,
                reg_to_json(registration),
                repr(self._clock()),
                *registration.namespaces,
            ],
        )
        if result[0] == b"unknown_ns":
            self._suspect()
            raise unserved_namespace(result[1])
        with self._lock:
            self._regs[registration.location] = registration
            self._own.add(registration.location)
        info = self._location(registration.location)
        assert info is not None
        return info

    def unregister(self, location: str) -> bool:
        done = self._call(
            self._drop, keys=[self._loc_key(location)], args=[self._p, location, "1", ""]
        )
        with self._lock:
            self._regs.pop(location, None)
            self._own.discard(location)
        return bool(done)

    def _location(self, name: str) -> LocationInfo | None:
        pipe = self._r.pipeline(transaction=False)
        pipe.hmget(self._loc_key(name), *LOC_FIELDS)
        raw = self._call(pipe.execute)[0]
        if raw[0] is None:
            return None
        idx = int(raw[5])
        pipe = self._r.pipeline(transaction=False)
        for t in range(len(INDEX_TIERS)):
            pipe.hlen(self._p + b"e:" + str(idx * TIER_BITS + t).encode())
        return location_info(raw, self._call(pipe.execute))

    def location(self, name: str) -> LocationInfo | None:
        return self._location(name)

    def locations(self) -> list[LocationInfo]:
        names = self._call(self._r.hkeys, self._p + b"locs")
        out = []
        for name in sorted(n.decode() for n in names):
            info = self._location(name)
            if info is not None:
                out.append(info)
        return out

    def heartbeat(self, locations: Sequence[str]) -> list[HeartbeatStatus]:
        now = repr(self._clock())
        pipe = self._r.pipeline(transaction=False)
        for name in locations:
            self._heartbeat(keys=[self._loc_key(name)], args=[now], client=pipe)
        statuses = [HeartbeatStatus(r.decode()) for r in self._call(pipe.execute)]
        if HeartbeatStatus.UNKNOWN in statuses:  # an idle writer's only sign of a reset
            self._suspect()
        return statuses

    def drop(self, location: str) -> bool:
        done = self._call(
            self._drop, keys=[self._loc_key(location)], args=[self._p, location, "0", ""]
        )
        return bool(done)

    def reap(self, timeout_s: float) -> list[str]:
        deadline = self._clock() - timeout_s
        dropped = []
        names = [n.decode() for n in self._call(self._r.hkeys, self._p + b"locs")]
        for name in names:
            done = self._call(
                self._drop,
                keys=[self._loc_key(name)],
                args=[self._p, name, "0", repr(deadline)],
            )
            if done:
                dropped.append(name)
        return dropped

    def claim(self, location: str, owner: str, ttl_s: float) -> bool:
        key = self._p + b"w:" + location.encode()
        ttl_ms = int(ttl_s * 1000)
        if self._max_claim_ms:
            ttl_ms = min(ttl_ms, self._max_claim_ms)
        args = [owner, max(ttl_ms, 1), self._max_claim_ms]
        return bool(self._call(self._claim, keys=[key], args=args))

    # -- writes -------------------------------------------------------------------------------

    def _check_known(self, check: Callable[[], None]) -> None:
        """Run a validation; an unknown namespace may mean Redis lost its data."""
        try:
            check()
        except KvtierError as exc:
            if exc.code is ErrorCode.UNKNOWN_NAMESPACE:
                self._suspect()
            raise

    def _known_ns(self, ops: Sequence[ChunkOp]) -> dict[bytes, None]:
        known: dict[bytes, None] = {}
        for op in ops:
            if (
                op.kind is not EventKind.CLEARED
                and op.ns_id not in known
                and self._namespace(op.ns_id)[0]
            ):
                known[op.ns_id] = None
        return known

    def apply(
        self,
        location: str,
        ops: Sequence[ChunkOp],
        *,
        epoch: int = 0,
        seq_from: int = 0,
        seq_to: int = 0,
    ) -> ApplyStatus:
        self._check_known(lambda: check_ops(ops, self._known_ns(ops)))
        check_seq_range(seq_from, seq_to)
        args = apply_args(self._p, epoch, seq_from, seq_to, self._clock(), ops)
        result = self._call(self._apply, keys=[self._loc_key(location)], args=args).decode()
        if result == "unknown":
            self._suspect()
            raise unknown_location(location)
        return ApplyStatus(result)

    def replace(
        self,
        location: str,
        holdings: Mapping[Tier, Mapping[bytes, Sequence[bytes]]],
        *,
        epoch: int,
        seq: int,
    ) -> None:
        known = {ns: None for by_ns in holdings.values() for ns in by_ns if self._namespace(ns)[0]}
        self._check_known(lambda: check_holdings(holdings, known))
        loc_key = self._loc_key(location)
        begun = self._call(
            self._begin_replace,
            keys=[loc_key],
            args=[self._p, str(epoch), seq, repr(self._clock())],
        )
        if begun == b"unknown":
            self._suspect()
            raise unknown_location(location)
        for tier, by_ns in holdings.items():
            for ns_id, keys in by_ns.items():
                for start in range(0, len(keys), REPLACE_BATCH):
                    part = tuple(keys[start : start + REPLACE_BATCH])
                    status = self.apply(location, [ChunkOp(EventKind.STORED, tier, ns_id, part)])
                    if status is not ApplyStatus.APPLIED:  # dropped meanwhile: writer resyncs
                        return

    # -- reads --------------------------------------------------------------------------------

    def query(self, queries: Sequence[Query]) -> list[QueryResult]:
        try:
            resolved = []
            for q in queries:
                known, namespace = self._namespace(q.ns_id)
                ns_map: dict[bytes, Namespace | None] = {q.ns_id: namespace} if known else {}
                resolved.append(resolve_keys(q, ns_map))
            asked = [b"".join(keys) for keys in resolved if keys]
            ns_key = [self._p + b"ns"]  # declared: a cluster routes the script by it
            if len(asked) == 1:  # one prompt: no pipeline to pay for
                raw = iter([self._call(self._query_script, keys=ns_key, args=[self._p, asked[0]])])
            elif asked:
                pipe = self._r.pipeline(transaction=False)
                for blob in asked:
                    self._query_script(keys=ns_key, args=[self._p, blob], client=pipe)
                raw = iter(self._call(pipe.execute))
            else:
                raw = iter(())
        except KvtierError as exc:
            if exc.code is not ErrorCode.UNAVAILABLE:
                raise
            return [QueryResult(q.ns_id, 0, (), IndexHealth.DEGRADED) for q in queries]
        out = []
        for q, keys in zip(queries, resolved, strict=True):
            if not keys:
                out.append(QueryResult(q.ns_id, 0, ()))
                continue
            slot_out, loc_out = next(raw)
            holdings = holdings_from_reply(slot_out, loc_out, self._registration)
            out.append(QueryResult(q.ns_id, len(keys), holdings))
        return out

    def _registration(self, name: str) -> Registration | None:
        with self._lock:
            reg = self._regs.get(name)
        if reg is None:
            raw = self._call(self._r.hget, self._loc_key(name), "reg")
            if raw is None:
                return None
            reg = reg_from_json(raw)
            with self._lock:
                self._regs[name] = reg
        return reg

    def stats(self) -> dict[str, int | float | str]:
        infos = self.locations()
        out: dict[str, int | float | str] = {
            "backend": "redis",
            "namespaces": self._call(self._r.hlen, self._p + b"ns"),
            "locations_up": sum(1 for i in infos if i.status is LocationStatus.UP),
            "locations_down": sum(1 for i in infos if i.status is LocationStatus.DOWN),
        }
        for tier in INDEX_TIERS:
            out[f"entries_{tier.value}"] = sum(i.entries[tier] for i in infos)
        return out

    def health(self) -> tuple[IndexHealth, str]:
        """Also the generation check: a Redis that lost its data answers pings too."""
        try:
            self._call(self._watch.check)
        except KvtierError as exc:
            resets = self._watch.state()
            if resets.recovering:
                return IndexHealth.DEGRADED, f"{resets.reason}: resyncing ({exc.message})"
            return IndexHealth.DEGRADED, exc.message
        return IndexHealth.OK, f"redis {self.url}"

    def backend_resets(self) -> BackendResets:
        return self._watch.state()

    def flush(self) -> int:
        """Delete every key under the prefix (tests, benchmarks). Returns how many."""
        n = 0
        for key in self._r.scan_iter(match=self._p + b"*", count=10000):
            n += self._r.delete(key)
        with self._lock:
            self._ns.clear()
            self._regs.clear()
            self._own.clear()
        self._watch.forget()  # the generation went too, on purpose: not a reset
        return n

    def close(self) -> None:
        self._r.close()
