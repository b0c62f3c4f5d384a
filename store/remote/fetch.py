"""Pulling chunks from a peer store into this store's pool (the remote tier's read path).

    fetch(ns_id, keys, holder)
      1. lease the keys at the holder (gRPC ``LeaseForPeer``): the longest prefix it holds,
         pinned, with the checksum of every chunk;
      2. allocate pages here for those not already here (normal write lease);
      3. read every chunk's bytes from the holder's pool into those pages in ONE transfer
         batch (``Transport.read``), verifying each chunk's checksum as soon as it lands;
      4. commit the verified chunks (with that checksum: no second pass), give back the rest
         (pages of chunks whose transfer did not finish are quarantined: late bytes may land);
      5. release the holder's lease (in the background, batched with other fetches' releases:
         the checksum already proved the bytes).

The caller then looks the keys up locally and loads them like any DRAM hit. Every peer failure
is a ``FetchStatus``, never an exception, and every step is bounded by the fetch deadline.
The holder must be a peer this store knows (``PeerDirectory``: configured, or listed by the
index) and prove a node credential; any other answers PEER_UNREACHABLE with ``NOT_A_PEER``
before anything is dialed, as does a known one that does not answer (no port oracle).

Threading: thread-safe; fetches run concurrently (the store's core serialises metadata).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence

import xxhash

from kvtier.core.chunks import ChunkLocation, LookupStatus
from kvtier.core.config.store import RemoteConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace
from kvtier.store.api.remote import FetchResult, FetchStatus
from kvtier.store.api.types import AllocStatus, LeaseStatus, LookupResult
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.store.client.shm import SharedSegment, checksum_views
from kvtier.store.remote.peers import NOT_A_PEER, PeerClients, PeerUnavailable
from kvtier.store.remote.transport import (
    PeerPool,
    RangeError,
    ReadOp,
    TransferStatus,
    Transport,
    plan_ops,
    split_ops,
)
from kvtier.store.state.core import StoreCore

log = logging.getLogger(__name__)

LEASE_MARGIN_S = 5.0  # holder lease outlives the fetch deadline by this much
# Large ranges are cut into ops of at most this: the engine moves ops over several TCP lanes
# (or QPs) at once, and hashing can follow a big chunk as it lands.
MAX_OP_BYTES = 4 << 20
RELEASE_COALESCE_S = 0.005  # holder leases ended within this window go in one Release call

_TRANSFER_STATUS = {
    TransferStatus.PEER_UNREACHABLE: FetchStatus.PEER_UNREACHABLE,
    TransferStatus.TIMEOUT: FetchStatus.TIMEOUT,
    TransferStatus.FAILED: FetchStatus.TRANSFER_FAILED,
}

COUNTERS = (
    "fetches",
    "fetched_chunks",
    "fetched_bytes",
    "checksum_mismatches",
    "served_leases",
    "served_chunks",
    "served_bytes",
    "served_checksums",
)


class Fetcher:
    def __init__(
        self,
        core: StoreCore,
        segment: SharedSegment,
        transport: Transport,
        config: RemoteConfig,
        peers: PeerClients,
    ) -> None:
        self.core = core
        self.segment = segment
        self.transport = transport
        self.config = config
        self.peers = peers
        self.quarantine_s = max(config.quarantine_s, transport.late_write_window_s + 1.0)
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self.failures: Counter[str] = Counter()  # by FetchStatus of fetches that fell short
        self._releaser = _ReleaseBatcher(peers)

    # -- holder side -------------------------------------------------------------------------

    def lease_for_peer(
        self, ns_id: bytes, keys: Sequence[bytes], lease_ttl_s: float | None, session: int = 0
    ) -> LookupResult:
        """Lookup + read lease (under the peer's ``session``), every hit with its checksum
        (computed now where the background checksummer has not got to it yet: a peer must be
        able to verify what it reads)."""
        ttl = lease_ttl_s or self.core.lease_ttl_s
        result = self.core.lookup(ns_id, keys, ttl, session=session)
        if not result.lease_id:
            return result
        entries = self.core.upkeep.read_lease_entries(result.lease_id)
        missing = [e for e in entries if not e.checksum]
        if missing:
            computed = []
            for entry in missing:
                views = self.segment.views(self.core.upkeep.location_of(entry).extents)
                computed.append((entry, checksum_views(views)))
            self.core.upkeep.record_checksums(computed)
        hits = [self.core.upkeep.location_of(e) for e in entries]
        with self._lock:
            self.counters["served_leases"] += 1
            self.counters["served_chunks"] += len(hits)
            self.counters["served_bytes"] += sum(h.size for h in hits)
            self.counters["served_checksums"] += len(missing)
        return LookupResult(hits, result.stop, result.lease_id, result.epoch, result.lease_ttl_s)

    # -- puller side -------------------------------------------------------------------------

    def fetch(
        self, ns_id: bytes, keys: Sequence[bytes], holder: str, timeout_s: float | None = None
    ) -> FetchResult:
        info = self.core.namespace(ns_id)  # UNKNOWN_NAMESPACE: the caller's mistake, raised
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "duplicate keys in one fetch")
        if timeout_s is not None and not timeout_s > 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"fetch timeout must be > 0: {timeout_s}")
        if not holder:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "fetch needs the holder's address")
        timeout = timeout_s or self.config.fetch_timeout_s
        deadline = time.monotonic() + timeout
        with self._lock:
            self.counters["fetches"] += 1
        reasons: dict[int, tuple[FetchStatus, str]] = {}
        phases: dict[str, float] = {}
        holder_hits = 0
        moved = fetched = mismatches = 0
        if keys:
            # the run's chunks already here stay while the rest is allocated (as a disk
            # stage: DiskBackend.stage), or the fetch could evict its own run's cold end
            _, pinned = self.core.pin_committed(ns_id, keys)
            try:
                moved, fetched, mismatches, holder_hits = self._pull(
                    ns_id, info.namespace, info.chunk_bytes, keys, holder, deadline, reasons,
                    phases,
                )  # fmt: skip
            except _Stop as stop:  # nothing was allocated: every key gets the one reason
                reasons = dict.fromkeys(range(len(keys)), (stop.status, stop.message))
            finally:
                self.core.upkeep.unpin(pinned)
        present = self.core.committed_mask(ns_id, keys)
        local = next((i for i, p in enumerate(present) if not p), len(keys))
        if local == len(keys):
            status, message = FetchStatus.OK, ""
        else:
            status, message = reasons.get(
                local, (FetchStatus.BUSY, "chunk was removed here meanwhile")
            )
        with self._lock:
            self.counters["fetched_chunks"] += fetched
            self.counters["fetched_bytes"] += moved
            self.counters["checksum_mismatches"] += mismatches
            if status is not FetchStatus.OK:
                self.failures[status.value] += 1
        return FetchResult(
            status, local, fetched, moved, holder_hits, mismatches, tuple(present), message,
            phases,
        )  # fmt: skip

    def _pull(
        self,
        ns_id: bytes,
        namespace: Namespace,
        chunk_bytes: int,
        keys: list[bytes],
        holder: str,
        deadline: float,
        reasons: dict[int, tuple[FetchStatus, str]],
        phases: dict[str, float],
    ) -> tuple[int, int, int, int]:
        """Steps 1-5. Fills ``reasons`` for keys that did not become local and ``phases``
        with the seconds each step took; returns (bytes moved, chunks fetched, checksum
        mismatches, holder hits)."""
        # 1. Lease at the holder.
        start = time.perf_counter()
        try:
            client, lease = self._lease_at_holder(
                ns_id, namespace, chunk_bytes, keys, holder, deadline
            )
        finally:
            phases["holder_lease"] = time.perf_counter() - start
        hits: list[ChunkLocation] = lease.hits
        for i in range(len(hits), len(keys)):
            if lease.stop is LookupStatus.PENDING and i == len(hits):
                reasons[i] = (FetchStatus.BUSY, "the holder is still writing this chunk")
            else:
                reasons[i] = (FetchStatus.HOLDER_MISS, f"{holder} does not hold this chunk")
        try:
            if not hits:
                return 0, 0, 0, 0
            landed = self._transfer(ns_id, chunk_bytes, hits, client, deadline, reasons, phases)
            return (*landed, len(hits))
        finally:
            if lease.lease_id:
                self._releaser.add(holder, lease.lease_id)

    def _lease_at_holder(
        self,
        ns_id: bytes,
        namespace: Namespace,
        chunk_bytes: int,
        keys: list[bytes],
        holder: str,
        deadline: float,
    ) -> tuple[GrpcStoreClient, LookupResult]:
        ttl = max(0.1, deadline - time.monotonic()) + LEASE_MARGIN_S

        def lease(client: GrpcStoreClient) -> tuple[GrpcStoreClient, LookupResult]:
            info = client.info()
            if not info.transfer_address:
                raise _Stop(FetchStatus.PEER_UNREACHABLE, f"{holder} serves no remote tier")
            timeout = min(self.config.rpc_timeout_s, max(0.05, deadline - time.monotonic()))
            return client, client.lease_for_peer(ns_id, keys, ttl, timeout_s=timeout)

        try:
            return self.peers.call(holder, (ns_id, namespace, chunk_bytes), lease)
        except PeerUnavailable:  # not a known peer, or it did not answer or prove itself
            raise _Stop(FetchStatus.PEER_UNREACHABLE, NOT_A_PEER) from None
        except KvtierError as exc:  # from a peer this store knows and reached before
            if exc.code is ErrorCode.UNAVAILABLE:
                if time.monotonic() >= deadline or "Deadline" in exc.message:
                    raise _Stop(FetchStatus.TIMEOUT, f"{holder}: {exc.message}") from None
                # gone since: the answer of one never reached (which holder is down is no
                # secret, but what it says when down would tell its port's state)
                log.debug("peer store %s: %s", holder, exc.message)
                raise _Stop(FetchStatus.PEER_UNREACHABLE, NOT_A_PEER) from None
            raise _Stop(FetchStatus.REFUSED, f"{holder} refused: {exc}") from None

    def _transfer(
        self,
        ns_id: bytes,
        chunk_bytes: int,
        hits: list[ChunkLocation],
        client: GrpcStoreClient,
        deadline: float,
        reasons: dict[int, tuple[FetchStatus, str]],
        phases: dict[str, float],
    ) -> tuple[int, int, int]:
        """Steps 2-4 for the keys the holder leased; returns (bytes, chunks, mismatches)."""
        holder_info = client.info()
        usable = []
        for i, hit in enumerate(hits):
            if hit.size == chunk_bytes and hit.checksum:
                usable.append(i)
            else:
                reasons[i] = (
                    FetchStatus.REFUSED,
                    f"holder sent a {hit.size}-byte chunk with checksum {hit.checksum}",
                )
        if not usable:
            return 0, 0, 0
        alloc_ttl = max(0.1, deadline - time.monotonic()) + self.quarantine_s + LEASE_MARGIN_S
        start = time.perf_counter()
        alloc = self.core.allocate(
            ns_id, [hits[i].key for i in usable], [chunk_bytes] * len(usable), alloc_ttl
        )
        phases["allocate"] = time.perf_counter() - start
        # 2. Which chunks to move, and their ops (chunk order, so a prefix lands first).
        chunk_ops: dict[int, list[int]] = {}  # hit index -> op indices
        local_loc: dict[int, ChunkLocation] = {}
        ops: list[ReadOp] = []
        give_back: list[bytes] = []  # allocated but not to be transferred
        for i, status, loc in zip(usable, alloc.statuses, alloc.locations, strict=True):
            hit = hits[i]
            if status is AllocStatus.IN_PROGRESS:
                reasons[i] = (FetchStatus.BUSY, "another writer is storing this chunk here")
            elif status is AllocStatus.NO_SPACE:
                reasons[i] = (FetchStatus.NO_SPACE, "no room in this pool")
            elif status is AllocStatus.ALLOCATED:
                assert loc is not None
                try:
                    planned = split_ops(
                        plan_ops(
                            loc.extents, hit.extents, self.segment.size, holder_info.segment_size
                        ),
                        MAX_OP_BYTES,
                    )
                except RangeError as exc:
                    reasons[i] = (FetchStatus.REFUSED, f"bad location from holder: {exc}")
                    give_back.append(hit.key)
                    continue
                chunk_ops[i] = list(range(len(ops), len(ops) + len(planned)))
                local_loc[i] = loc
                ops.extend(planned)
        if give_back:
            self.core.abort(alloc.lease_id, give_back)
        if not chunk_ops:
            return 0, 0, 0

        # 3. One batch. Each chunk is hashed while it lands: ops of a chunk are in byte order,
        # so the hash runs over the chunk's landed prefix and ends with its last op.
        op_chunk = {o: i for i, os_ in chunk_ops.items() for o in os_}
        landed: set[int] = set()
        hashed = dict.fromkeys(chunk_ops, 0)  # hit index -> ops of it hashed so far
        hashers = {i: xxhash.xxh3_64() for i in chunk_ops}
        verified: dict[int, int] = {}  # hit index -> checksum (matched)
        mismatched: list[int] = []
        array = self.segment.array

        def on_done(op: int) -> None:
            landed.add(op)
            i = op_chunk[op]
            own = chunk_ops[i]
            while hashed[i] < len(own) and own[hashed[i]] in landed:
                o = ops[own[hashed[i]]]
                hashers[i].update(array[o.local_offset : o.local_offset + o.length].data)
                hashed[i] += 1
            if hashed[i] == len(own):
                if (hashers[i].intdigest() or 1) == hits[i].checksum:  # as checksum_views
                    verified[i] = hits[i].checksum
                else:
                    mismatched.append(i)

        peer = PeerPool(
            holder_info.transfer_address, holder_info.transfer_base, holder_info.segment_size
        )
        timeout = deadline - time.monotonic()
        start = time.perf_counter()
        if timeout > 0:
            result = self.transport.read(peer, ops, timeout, on_done)
            failed_status = _TRANSFER_STATUS.get(result.status, FetchStatus.TRANSFER_FAILED)
            failed_message, submitted = result.message, result.submitted
        else:
            failed_status, failed_message, submitted = FetchStatus.TIMEOUT, "no time left", 0

        # 4. Commit what verified; give back the rest.
        phases["transfer"] = time.perf_counter() - start  # with the hashing as chunks landed
        start = time.perf_counter()
        commit_keys = [hits[i].key for i in sorted(verified)]
        if commit_keys:
            self.core.commit(alloc.lease_id, commit_keys, [verified[i] for i in sorted(verified)])
        if mismatched:  # fully landed, so no late bytes: the pages can be reused at once
            self.core.abort(alloc.lease_id, [hits[i].key for i in mismatched])
            for i in mismatched:
                reasons[i] = (FetchStatus.CHECKSUM_MISMATCH, "bytes differ from the checksum")
            log.warning("%d chunk(s) from %s failed their checksum", len(mismatched), peer.address)
        unfinished = [i for i in chunk_ops if i not in verified and i not in mismatched]
        if unfinished:
            # A chunk any of whose ops was submitted may still receive bytes: quarantine it.
            started = [i for i in unfinished if chunk_ops[i][0] < submitted]
            never = [i for i in unfinished if chunk_ops[i][0] >= submitted]
            if started:
                self.core.abort(
                    alloc.lease_id, [hits[i].key for i in started], quarantine_s=self.quarantine_s
                )
            if never:
                self.core.abort(alloc.lease_id, [hits[i].key for i in never])
            for i in unfinished:
                reasons[i] = (failed_status, failed_message)
        phases["commit"] = time.perf_counter() - start
        moved = sum(hits[i].size for i in verified)
        return moved, len(verified), len(mismatched)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {f"remote_{k}": v for k, v in self.counters.items()}
            for status in FetchStatus:
                if status is not FetchStatus.OK:
                    out[f"remote_fetch_{status.value}"] = self.failures[status.value]
        return out

    def close(self) -> None:
        self._releaser.close()


class _Stop(Exception):
    def __init__(self, status: FetchStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _ReleaseBatcher:
    """Ends holder leases off the fetch's path: one Release call per holder for all the leases
    that ended within a few milliseconds (a burst of small fetches costs one round trip)."""

    def __init__(self, peers: PeerClients) -> None:
        self.peers = peers
        self._cond = threading.Condition()
        self._pending: dict[str, list[int]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kvtier-release", daemon=True)
        self._thread.start()

    def add(self, holder: str, lease_id: int) -> None:
        with self._cond:
            self._pending.setdefault(holder, []).append(lease_id)
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if self._closed and not self._pending:
                    return
            time.sleep(RELEASE_COALESCE_S)
            with self._cond:
                batch, self._pending = self._pending, {}
            for holder, ids in batch.items():
                try:
                    statuses = self.peers.call(holder, None, functools.partial(_release, ids=ids))
                except KvtierError as exc:  # the holder's leases expire on their own
                    log.debug("releasing %d leases at %s: %s", len(ids), holder, exc)
                    continue
                lapsed = sum(1 for st in statuses if st is not LeaseStatus.OK)
                if lapsed:
                    log.info("%d lease(s) at %s ended before release", lapsed, holder)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=2.0)


def _release(client: GrpcStoreClient, ids: list[int]) -> list[LeaseStatus]:
    return client.release(ids)
