"""In-memory chunk index: the embedded default, and the reference for the Redis backend.

Layout. Each location gets a small integer ``idx`` (reused after it is forgotten); the pair
(location, tier) is the *slot* ``idx * TIER_BITS + tier``. ``_holders`` maps a chunk key to an
int bitmap of the slots that hold it, so a query walks the prompt's keys once, ANDing bitmaps
(O(chunks in the prompt), whatever the index holds). Each location keeps, per tier, a dict
key -> time stored, which gives recency and makes dropping a location O(its entries).

Threading: one lock around every operation; a query holds it for its whole walk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from kvtier.core.chunks import Tier
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import KEY_BYTES, Namespace
from kvtier.index.api import (
    INDEX_TIERS,
    TIER_BITS,
    TIER_INDEX,
    ApplyStatus,
    ChunkIndex,
    ChunkOp,
    Cursor,
    HeartbeatStatus,
    Holding,
    IndexHealth,
    LocationInfo,
    LocationStatus,
    Query,
    QueryResult,
    Registration,
)
from kvtier.index.client.changes import LocationDump
from kvtier.index.rules import (
    check_cursor,
    check_holdings,
    check_ops,
    check_registration,
    order_holdings,
    resolve_keys,
    too_many_namespaces,
    unknown_location,
    unserved_namespace,
)
from kvtier.store.api.events import EventKind

_NO_CURSOR = Cursor(0, 0)


class _Location:
    __slots__ = ("cursor", "entries", "idx", "last_seen", "registration", "status")

    def __init__(self, registration: Registration, idx: int, now: float) -> None:
        self.registration = registration
        self.idx = idx
        self.status = LocationStatus.UP
        self.last_seen = now
        self.cursor = _NO_CURSOR
        self.entries: list[dict[bytes, float]] = [{} for _ in INDEX_TIERS]

    def info(self) -> LocationInfo:
        return LocationInfo(
            self.registration,
            self.status,
            self.last_seen,
            self.cursor,
            {tier: len(self.entries[i]) for i, tier in enumerate(INDEX_TIERS)},
        )


def fold_mask(capacity: int) -> int:
    """Bitmap with the first slot of each of ``capacity`` locations set (0x...1111)."""
    return ((1 << (TIER_BITS * capacity)) - 1) // ((1 << TIER_BITS) - 1)


def leading_runs(bitmaps: Sequence[int], low: int) -> tuple[dict[int, int], dict[int, int], int]:
    """Leading runs of a prompt given each chunk's holder bitmap.

    Returns (slot -> run, location idx -> run across tiers, chunks walked). ``low`` is
    ``fold_mask`` of at least every location present. Shared by both backends.
    """
    n = len(bitmaps)
    if n == 0 or not bitmaps[0]:
        return {}, {}, 0
    slot_end: dict[int, int] = {}
    loc_end: dict[int, int] = {}
    tier_act = bitmaps[0]
    loc_act = (tier_act | tier_act >> 1 | tier_act >> 2 | tier_act >> 3) & low
    mixed = False  # some active location has no active tier slot (it moved between tiers)
    i = 1
    while i < n and loc_act:
        m = bitmaps[i]
        gone = tier_act & ~m
        if gone:
            tier_act ^= gone
            while gone:
                bit = gone & -gone
                slot_end[bit.bit_length() - 1] = i
                gone ^= bit
            mixed = True
        if mixed:
            f = (m | m >> 1 | m >> 2 | m >> 3) & low
            lost = loc_act & ~f
            if lost:
                loc_act ^= lost
                while lost:
                    bit = lost & -lost
                    loc_end[(bit.bit_length() - 1) // TIER_BITS] = i
                    lost ^= bit
            fa = (tier_act | tier_act >> 1 | tier_act >> 2 | tier_act >> 3) & low
            mixed = fa != loc_act
        i += 1
    while tier_act:
        bit = tier_act & -tier_act
        slot_end[bit.bit_length() - 1] = i
        tier_act ^= bit
    while loc_act:
        bit = loc_act & -loc_act
        loc_end[(bit.bit_length() - 1) // TIER_BITS] = i
        loc_act ^= bit
    return slot_end, loc_end, i


class MemoryIndex(ChunkIndex):
    def __init__(
        self, clock: Callable[[], float] = time.time, max_namespaces: int | None = None
    ) -> None:
        """``max_namespaces``: refuse a new namespace past this many (None: no bound)."""
        self._clock = clock
        self._max_ns = max_namespaces
        self._lock = threading.RLock()
        self._ns: dict[bytes, Namespace | None] = {}
        self._locs: dict[str, _Location] = {}
        self._by_idx: list[_Location | None] = []
        self._free: list[int] = []
        self._holders: dict[bytes, int] = {}
        self._low = 0

    # -- namespaces and locations -------------------------------------------------------------

    def register_namespace(self, namespace: Namespace | bytes) -> bytes:
        definition: Namespace | None = None
        if isinstance(namespace, Namespace):
            ns_id, definition = namespace.root_key(), namespace
        elif not isinstance(namespace, bytes) or len(namespace) != KEY_BYTES:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "a namespace id is 16 bytes")
        else:
            ns_id = namespace
        with self._lock:
            if ns_id not in self._ns and self._max_ns is not None and len(self._ns) >= self._max_ns:
                raise too_many_namespaces(self._max_ns)
            if definition is not None or ns_id not in self._ns:
                self._ns[ns_id] = definition
        return ns_id

    def namespaces(self) -> dict[bytes, Namespace | None]:
        with self._lock:
            return dict(self._ns)

    def namespace(self, ns_id: bytes) -> tuple[bool, Namespace | None]:
        with self._lock:
            return ns_id in self._ns, self._ns.get(ns_id)

    def register(self, registration: Registration) -> LocationInfo:
        check_registration(registration)
        with self._lock:
            for ns_id in registration.namespaces:
                if ns_id not in self._ns:
                    raise unserved_namespace(ns_id)
            now = self._clock()
            loc = self._locs.get(registration.location)
            if loc is None:
                idx = self._free.pop() if self._free else len(self._by_idx)
                loc = _Location(registration, idx, now)
                if idx == len(self._by_idx):
                    self._by_idx.append(loc)
                    self._low = fold_mask(len(self._by_idx))
                else:
                    self._by_idx[idx] = loc
                self._locs[registration.location] = loc
            else:
                loc.registration = registration
                loc.last_seen = now
                loc.status = LocationStatus.UP
            return loc.info()

    def unregister(self, location: str) -> bool:
        with self._lock:
            loc = self._locs.pop(location, None)
            if loc is None:
                return False
            self._clear(loc, None)
            self._by_idx[loc.idx] = None
            self._free.append(loc.idx)
            return True

    def locations(self) -> list[LocationInfo]:
        with self._lock:
            return [loc.info() for loc in self._locs.values()]

    def location(self, name: str) -> LocationInfo | None:
        with self._lock:
            loc = self._locs.get(name)
            return loc.info() if loc is not None else None

    def heartbeat(self, locations: Sequence[str]) -> list[HeartbeatStatus]:
        out = []
        with self._lock:
            now = self._clock()
            for name in locations:
                loc = self._locs.get(name)
                if loc is None:
                    out.append(HeartbeatStatus.UNKNOWN)
                    continue
                loc.last_seen = now
                if loc.status is LocationStatus.DOWN:
                    loc.status = LocationStatus.UP
                    out.append(HeartbeatStatus.RESYNC)
                else:
                    out.append(HeartbeatStatus.OK)
        return out

    def drop(self, location: str) -> bool:
        with self._lock:
            loc = self._locs.get(location)
            if loc is None:
                return False
            self._clear(loc, None)
            loc.status = LocationStatus.DOWN
            loc.cursor = _NO_CURSOR
            return True

    def reap(self, timeout_s: float) -> list[str]:
        with self._lock:
            deadline = self._clock() - timeout_s
            silent = [
                name
                for name, loc in self._locs.items()
                if loc.status is LocationStatus.UP and loc.last_seen < deadline
            ]
            for name in silent:
                self.drop(name)
            return silent

    # -- writes -------------------------------------------------------------------------------

    def _get(self, location: str) -> _Location:
        loc = self._locs.get(location)
        if loc is None:
            raise unknown_location(location)
        return loc

    def apply(
        self,
        location: str,
        ops: Sequence[ChunkOp],
        *,
        epoch: int = 0,
        seq_from: int = 0,
        seq_to: int = 0,
    ) -> ApplyStatus:
        with self._lock:
            loc = self._get(location)
            check_ops(ops, self._ns)
            verdict = check_cursor(loc.status, loc.cursor, epoch, seq_from, seq_to)
            if verdict is not None:
                return verdict
            now = self._clock()
            for op in ops:
                if op.kind is EventKind.STORED:
                    self._store(loc, TIER_INDEX[op.tier], op.keys, now)  # type: ignore[index]
                elif op.kind is EventKind.REMOVED:
                    self._remove(loc, TIER_INDEX[op.tier], op.keys)  # type: ignore[index]
                else:
                    self._clear(loc, op.tier)
            if seq_to:
                loc.cursor = Cursor(epoch, seq_to)
            loc.last_seen = now
            return ApplyStatus.APPLIED

    def replace(
        self,
        location: str,
        holdings: Mapping[Tier, Mapping[bytes, Sequence[bytes]]],
        *,
        epoch: int,
        seq: int,
    ) -> None:
        with self._lock:
            loc = self._get(location)
            check_holdings(holdings, self._ns)
            now = self._clock()
            self._clear(loc, None)
            for tier, by_ns in holdings.items():
                for keys in by_ns.values():
                    self._store(loc, TIER_INDEX[tier], keys, now)
            loc.cursor = Cursor(epoch, seq)
            loc.status = LocationStatus.UP
            loc.last_seen = now

    def _store(self, loc: _Location, tier: int, keys: Sequence[bytes], now: float) -> None:
        bit = 1 << (loc.idx * TIER_BITS + tier)
        holders = self._holders
        entries = loc.entries[tier]
        get = holders.get
        for key in keys:
            holders[key] = get(key, 0) | bit
            entries[key] = now

    def _remove(self, loc: _Location, tier: int, keys: Sequence[bytes]) -> None:
        keep = ~(1 << (loc.idx * TIER_BITS + tier))
        holders = self._holders
        entries = loc.entries[tier]
        for key in keys:
            if entries.pop(key, None) is not None:
                left = holders[key] & keep
                if left:
                    holders[key] = left
                else:
                    del holders[key]

    def _clear(self, loc: _Location, tier: Tier | None) -> None:
        for i, t in enumerate(INDEX_TIERS):
            if tier is None or tier is t:
                self._remove(loc, i, list(loc.entries[i]))

    # -- reads --------------------------------------------------------------------------------

    def query(self, queries: Sequence[Query]) -> list[QueryResult]:
        with self._lock:
            return [self._query(q) for q in queries]

    def _query(self, query: Query) -> QueryResult:
        keys = resolve_keys(query, self._ns)
        get = self._holders.get
        slot_end, loc_end, _ = leading_runs([get(k, 0) for k in keys], self._low)
        holdings = []
        for idx, total in loc_end.items():
            loc = self._by_idx[idx]
            if loc is None:  # pragma: no cover - bits of a forgotten location are cleared
                continue
            runs = {}
            for i, tier in enumerate(INDEX_TIERS):
                run = slot_end.get(idx * TIER_BITS + i, 0)
                if run:
                    runs[tier] = run
            last_key = keys[total - 1]
            stored_at = max(entries.get(last_key, 0.0) for entries in loc.entries)
            reg = loc.registration
            holdings.append(
                Holding(reg.location, reg.kind, reg.node, runs, total, loc.last_seen, stored_at)
            )
        return QueryResult(query.ns_id, len(keys), order_holdings(holdings))

    def stats(self) -> dict[str, int | float | str]:
        with self._lock:
            out: dict[str, int | float | str] = {
                "backend": "memory",
                "namespaces": len(self._ns),
                "locations_up": sum(
                    1 for loc in self._locs.values() if loc.status is LocationStatus.UP
                ),
                "locations_down": sum(
                    1 for loc in self._locs.values() if loc.status is LocationStatus.DOWN
                ),
                "keys": len(self._holders),
            }
            for i, tier in enumerate(INDEX_TIERS):
                out[f"entries_{tier.value}"] = sum(
                    len(loc.entries[i]) for loc in self._locs.values()
                )
            return out

    def health(self) -> tuple[IndexHealth, str]:
        return IndexHealth.OK, "in-memory backend"

    # -- copies (the change feed's snapshots, a router's replica: index/server/feed.py) ------

    def dump(self) -> tuple[dict[bytes, Namespace | None], list[LocationDump]]:
        """Every namespace and location with its entries (key -> when stored)."""
        with self._lock:
            locations = [
                LocationDump(
                    loc.info(),
                    {t: dict(loc.entries[i]) for i, t in enumerate(INDEX_TIERS) if loc.entries[i]},
                )
                for loc in self._locs.values()
            ]
            return dict(self._ns), locations

    def load(
        self, namespaces: Mapping[bytes, Namespace | None], locations: Sequence[LocationDump]
    ) -> None:
        """Become a copy of a dump: what was here before is forgotten."""
        with self._lock:
            self._ns = dict(namespaces)
            self._locs, self._by_idx, self._free, self._holders = {}, [], [], {}
            for dumped in locations:
                info = dumped.info
                loc = _Location(info.registration, len(self._by_idx), info.last_seen)
                loc.status, loc.cursor = info.status, info.cursor
                self._by_idx.append(loc)
                self._locs[info.registration.location] = loc
                for tier, entries in dumped.entries.items():
                    i = TIER_INDEX[tier]
                    bit = 1 << (loc.idx * TIER_BITS + i)
                    for key in entries:
                        self._holders[key] = self._holders.get(key, 0) | bit
                    loc.entries[i].update(entries)
            self._low = fold_mask(len(self._by_idx))
