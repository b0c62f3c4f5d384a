"""Demotion: a store above its high watermark moves its coldest chunks to a peer with room.

Eviction is synchronous with allocation and cannot wait for a network transfer, so demotion
runs ahead of it: a background thread checks the pool's fill every ``interval_s``; above
``high_watermark`` it takes the chunks eviction would take next (up to the low watermark, at
most ``max_batch_bytes`` a round), picks the configured peer with the most room below *its*
high watermark, and asks that peer to ``Fetch`` them from this store. Whatever the peer then
holds is deleted here. Both moves go through the stores' normal paths, so the events say it
all: STORED at the peer (its commit), REMOVED here (the delete).

Threading: one daemon thread; ``run_once`` may also be called directly (tests).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.core.config.store import RemoteConfig
from kvtier.core.errors import KvtierError
from kvtier.store.remote.peers import PeerClients
from kvtier.store.state.core import StoreCore

log = logging.getLogger(__name__)

MIN_RATE_BPS = 100e6  # demotion fetch deadline assumes at least this transfer rate


@dataclass(frozen=True, slots=True)
class DemotionRound:
    peer: str  # "" when no peer was tried
    moved_chunks: int
    moved_bytes: int
    message: str = ""


class Demoter:
    def __init__(
        self,
        core: StoreCore,
        config: RemoteConfig,
        peers: PeerClients,
        self_address: str,
    ) -> None:
        self.core = core
        self.config = config
        self.demotion = config.demotion
        self.peers = peers
        self.self_address = self_address
        self.counters = {"demoted_chunks": 0, "demoted_bytes": 0, "demotion_failures": 0}
        self._lock = threading.Lock()  # one round at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-demotion", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.config.fetch_timeout_s + 5)

    def _loop(self) -> None:
        while not self._stop.wait(self.demotion.interval_s):
            try:
                while not self._stop.is_set() and self.run_once().moved_chunks:
                    pass  # keep going while above the watermark and making progress
            except Exception:  # pragma: no cover - keep demoting after a bug report
                log.exception("demotion round failed")

    def over_watermark(self) -> int:
        """Bytes to move to get back to the low watermark (0 below the high one)."""
        stats = self.core.stats()
        capacity, used = int(stats["capacity_bytes"]), settled_used(stats)
        if used <= self.demotion.high_watermark * capacity:
            return 0
        return max(0, int(used - self.demotion.low_watermark * capacity))

    def run_once(self) -> DemotionRound:
        with self._lock:
            excess = self.over_watermark()
            if not excess:
                return DemotionRound("", 0, 0, "below the high watermark")
            budget = min(excess, int(self.demotion.max_batch_bytes))
            candidates = self.core.upkeep.coldest(budget)
            if not candidates:
                return DemotionRound("", 0, 0, "nothing evictable to demote")
            want = sum(size for _, _, size in candidates)
            peer, room = self._pick_peer(want)
            if not peer:
                self.counters["demotion_failures"] += 1
                return DemotionRound("", 0, 0, "no peer with room")
            moved_chunks = moved_bytes = 0
            for ns_id, keys, sizes in _by_namespace(candidates, room):
                chunks, nbytes = self._move(peer, ns_id, keys, sizes)
                moved_chunks += chunks
                moved_bytes += nbytes
            self.counters["demoted_chunks"] += moved_chunks
            self.counters["demoted_bytes"] += moved_bytes
            if not moved_chunks:
                self.counters["demotion_failures"] += 1
            return DemotionRound(peer, moved_chunks, moved_bytes)

    def _pick_peer(self, want: int) -> tuple[str, int]:
        """The peer with the most room below its high watermark (at least one chunk's worth)."""
        best, best_room = "", 0
        for address in self.config.peers:
            if address == self.self_address:
                continue
            try:
                stats = self.peers.call(address, None, lambda c: c.stats())
            except KvtierError as exc:
                log.info("demotion: peer %s unavailable: %s", address, exc)
                continue
            room = int(self.demotion.high_watermark * int(stats["capacity_bytes"])) - (
                settled_used(stats)
            )
            if room > best_room:
                best, best_room = address, room
        return best, min(best_room, want)

    def _move(
        self, peer: str, ns_id: bytes, keys: list[bytes], sizes: list[int]
    ) -> tuple[int, int]:
        info = self.core.namespace(ns_id)
        timeout = self.config.fetch_timeout_s + sum(sizes) / MIN_RATE_BPS
        try:
            result = self.peers.call(
                peer,
                (ns_id, info.namespace, info.chunk_bytes),
                lambda c: c.fetch(ns_id, keys, self.self_address, timeout),
            )
        except KvtierError as exc:
            log.warning("demotion to %s failed: %s", peer, exc)
            return 0, 0
        moved = [k for k, present in zip(keys, result.present, strict=False) if present]
        if moved:
            self.core.delete(ns_id, moved)
        if len(moved) < len(keys):
            log.info("demotion to %s: %d of %d moved (%s)", peer, len(moved), len(keys), result)
        size_of = dict(zip(keys, sizes, strict=True))
        return len(moved), sum(size_of[k] for k in moved)


def settled_used(stats: Mapping[str, int | float | str]) -> int:
    """A pool's used bytes less the pages that free themselves: chunks already deleted but
    still pinned by a reader's lease (``doomed``, e.g. a peer's lease on chunks it just pulled,
    released a few ms later) and quarantined pages. Counting them as used made the round right
    after a move see the moved chunks still there and move the rest of the pool."""
    return int(stats["used_bytes"]) - int(stats["doomed_bytes"]) - int(stats["quarantined_bytes"])


def _by_namespace(
    candidates: list[tuple[bytes, bytes, int]], room: int
) -> list[tuple[bytes, list[bytes], list[int]]]:
    """Candidates (coldest first) that fit ``room``, grouped by namespace."""
    groups: dict[bytes, tuple[list[bytes], list[int]]] = {}
    total = 0
    for ns_id, key, size in candidates:
        if total + size > room:
            break
        total += size
        keys, sizes = groups.setdefault(ns_id, ([], []))
        keys.append(key)
        sizes.append(size)
    return [(ns, keys, sizes) for ns, (keys, sizes) in groups.items()]
