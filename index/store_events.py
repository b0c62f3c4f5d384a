"""Following a node store's event stream (``store.proto`` ReadEvents / Snapshot).

The follower long-polls ``ReadEvents`` from the next sequence number: each answer is either
batches (applied with their sequence numbers) or, after ``probe_interval_s`` of quiet, an
empty list, which doubles as the store's heartbeat. A long poll rather than the Subscribe
stream, because a silent stream cannot tell an idle store from a dead one.

Recovery: the store says its buffer no longer holds what we ask (a gap), or answers from a
new epoch (it restarted), or the index answers RESYNC (dropped for silence, another writer,
an outage), or the backend lost its data (``Follower.take_reset``): register again, take a
``Snapshot`` (the store's whole state and the sequence number it reflects) and ``replace``
the node's entries with it, then read on from there. At start the follower
resumes from the index's cursor when the index already holds this store's epoch (a Redis
index outlives the index process), else it starts with a snapshot.

Threading: runs on its own thread; owns its store client.
"""

from __future__ import annotations

import logging

from kvtier.chunks import Tier
from kvtier.config_index import IndexConfig, StoreSource
from kvtier.errors import ErrorCode, KvtierError
from kvtier.index.api import ApplyStatus, ChunkIndex, ChunkOp, LocationKind, Registration
from kvtier.index.ingest import Follower, SourceState
from kvtier.keys import KEY_BYTES
from kvtier.rpc import ClientAuth
from kvtier.store.api.events import EventBatch, EventGap, EventKind

log = logging.getLogger(__name__)

_TIERS = {"gpu": Tier.GPU, "cpu": Tier.CPU, "disk": Tier.DISK}


class _StoreError(KvtierError):
    """A failed call to the store (as opposed to the index)."""


class StoreFollower(Follower):
    def __init__(
        self,
        source: StoreSource,
        index: ChunkIndex,
        config: IndexConfig,
        dynamic: bool = False,
        auth: ClientAuth | None = None,
    ) -> None:
        """``auth``: what the index presents to the store (an index credential)."""
        super().__init__(source.address, "store", index, config, dynamic)
        self.source = source
        self.auth = auth
        self._client = None
        self._node = ""  # the store's node id: our location name
        self._epoch = 0
        self._next = 0  # next store seq to read
        self._synced = False
        self._resume = True  # may read on from the index's cursor (until something went wrong)
        self._namespaces: set[bytes] = set()

    @property
    def location(self) -> str:
        return self._node

    def follow(self) -> None:
        while not self.halt.is_set():
            try:
                if self._client is None:
                    self._connect()
                if not self.is_writer():
                    self.stats.state = SourceState.STANDBY
                    self._synced = False
                    self.halt.wait(self.config.probe_interval_s)
                    continue
                if self.take_reset():  # the backend lost our namespaces, location and entries
                    self._namespaces.clear()
                    self._synced = self._resume = False
                if not self._synced:
                    self._resync()
                self._read()
            except _StoreError as exc:
                self.stats.state = SourceState.UNREACHABLE
                self._disconnect()
                self._failed(exc)
            except KvtierError as exc:
                self._failed(exc)

    def _failed(self, exc: KvtierError) -> None:
        self._synced = False
        if exc.code is ErrorCode.UNKNOWN_NAMESPACE:
            self._namespaces.clear()  # the backend forgot them: register them all again
        if exc.code is ErrorCode.UNKNOWN_LOCATION:
            self._namespaces.clear()  # re-register everything (see VllmFollower._flush)
            if self.dynamic:
                self.halt.set()
        self.stats.detail = exc.message
        log.debug("store %s: %s", self.source.address, exc)
        self.halt.wait(min(1.0, self.config.probe_interval_s))

    def _connect(self) -> None:
        from kvtier.store.client.grpc import GrpcStoreClient

        client = self._store_call(
            GrpcStoreClient, self.source.address, timeout_s=5.0, auth=self.auth
        )
        self._client = client
        info = client.info()
        self._node = info.node_id
        self.stats.source = info.node_id
        self.heard()
        if info.epoch != self._epoch:
            self._epoch = info.epoch
            self._synced = False
        self._register(())

    def _disconnect(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _register(self, namespaces: tuple[bytes, ...] | list[bytes]) -> None:
        new = [ns for ns in namespaces if ns not in self._namespaces]
        if new or not self._namespaces:
            for ns in new:
                self.index.register_namespace(ns)  # by id: the store validated them
            self._namespaces.update(new)
            self.index.register(
                Registration(
                    self._node,
                    LocationKind.NODE,
                    tuple(sorted(self._namespaces)),
                    endpoints={"store": self.source.address},
                )
            )

    def _store_call(self, fn, *args, **kwargs):  # -> Any
        try:
            return fn(*args, **kwargs)
        except KvtierError as exc:
            raise _StoreError(exc.code, f"store {self.source.address}: {exc.message}") from None

    def _resync(self) -> None:
        self.stats.state = SourceState.CATCHING_UP
        assert self._client is not None
        # a Redis index may already hold this epoch up to some seq: read on from there
        if self._resume:
            self._resume = False  # once: after a gap or a resync, a snapshot is the answer
            info = next(
                (i for i in self.index.locations() if i.registration.location == self._node), None
            )
            if info is not None and info.cursor.epoch == self._epoch and info.cursor.seq:
                self._next = info.cursor.seq + 1
                self._synced = True
                return
        resets = self.index.backend_resets().resets  # before: a reset during this is owed again
        snap = self._store_call(self._client.snapshot)
        self._register(list(snap.chunks))
        self.index.replace(self._node, {Tier.CPU: snap.chunks}, epoch=self._epoch, seq=snap.seq)
        self._next = snap.seq + 1
        self._synced = True
        self.resynced_for = resets
        self.stats.resyncs += 1

    def _read(self) -> None:
        assert self._client is not None
        got = self._store_call(
            self._client.read_events, self._next, 256, self.config.probe_interval_s
        )
        self.heard()
        if isinstance(got, EventGap):
            log.info("store %s: events %d.. gone, taking a snapshot", self._node, got.requested)
            self.stats.gaps_recovered += 1
            self._synced = False
            return
        if not got:
            info = self._store_call(self._client.info)
            if info.epoch != self._epoch:
                self._restarted(info.epoch)
                return
            self.beat()
            if self.stats.state is not SourceState.LIVE:
                self.stats.state = SourceState.LIVE
                self.stats.detail = ""
            return
        if any(batch.epoch != self._epoch for batch in got):
            self._restarted(got[-1].epoch)
            return
        ops = self._ops(got)
        status = self.index.apply(
            self._node, ops, epoch=self._epoch, seq_from=got[0].seq, seq_to=got[-1].seq
        )
        if status is ApplyStatus.RESYNC:
            self._synced = False
            return
        self._next = got[-1].seq + 1
        self.stats.state = SourceState.LIVE
        self.stats.detail = ""

    def _restarted(self, epoch: int) -> None:
        log.warning("store %s restarted (epoch %x)", self._node, epoch)
        self.stats.restarts += 1
        assert self._client is not None
        self._client.reattach()
        self._epoch = epoch
        self._synced = False

    def _ops(self, batches: list[EventBatch]) -> list[ChunkOp]:
        ops: list[ChunkOp] = []
        new_ns = []
        for batch in batches:
            self.stats.batches += 1
            for ev in batch.events:
                self.stats.events[ev.kind.value] += 1
                tier = _TIERS.get(ev.tier)
                if tier is None:
                    self.stats.rejected["unknown_tier"] += 1
                    continue
                if ev.kind is EventKind.CLEARED:
                    ops.append(ChunkOp(EventKind.CLEARED, None))
                    continue
                if len(ev.namespace) != KEY_BYTES or any(len(k) != KEY_BYTES for k in ev.keys):
                    self.stats.rejected["malformed_event"] += 1
                    continue
                if ev.namespace not in self._namespaces:
                    new_ns.append(ev.namespace)
                ops.append(ChunkOp(ev.kind, tier, ev.namespace, ev.keys))
        if new_ns:
            self._register(list(dict.fromkeys(new_ns)))
        return ops

    def stop(self, timeout: float = 5.0) -> None:
        super().stop(timeout)
        if not self.is_alive():
            self._disconnect()
