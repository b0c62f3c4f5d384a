"""Following a node store's event stream (``store.proto`` ReadEvents / Snapshot).

The follower long-polls ``ReadEvents`` from the next sequence number: each answer is either
batches (applied with their sequence numbers) or, after ``probe_interval_s`` of quiet, an
empty list, which doubles as the store's heartbeat. A long poll rather than the Subscribe
stream, because a silent stream cannot tell an idle store from a dead one.

Recovery: the store says its buffer no longer holds what we ask (a gap), or answers from a
new epoch (it restarted), or the index answers RESYNC (dropped for silence, another writer,
an outage) or DUPLICATE (its cursor is ahead of what this follower wrote: someone else moved
it), or the backend lost its data (``Follower.take_reset``): register again, take a
``Snapshot`` (the store's whole state and the sequence number it reflects) and ``replace``
the node's entries with it, then read on from there. At start the follower resumes from the
index's cursor when the index already holds this store's epoch (a Redis index outlives the
index process) and the store has produced that batch, else it starts with a snapshot: a
cursor beyond what the store produced would have it wait for batches that never come.

Trust: the address may come from a registration (``Register`` over the API), i.e. from
someone else. Before the index presents its own credential there, the store proves it holds
a node credential (``verify_store``, an open challenge); for a registration, it must be the
credential that registered it (an operator's registration, or a configured store: any node
credential), and the store must be the node it was registered as. A store that cannot
prove it is not followed (state ``failed``) and never sees the index's token.

Threading: runs on its own thread; owns its store client.
"""

from __future__ import annotations

import logging

from kvtier.core.auth import Authenticator
from kvtier.core.chunks import Tier
from kvtier.core.config.index import IndexConfig, StoreSource
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import KEY_BYTES
from kvtier.core.rpc import ClientAuth
from kvtier.index.api import ApplyStatus, ChunkIndex, ChunkOp, LocationKind, Registration
from kvtier.index.ingest.follower import Follower, SourceState
from kvtier.store.api import StoreAdmin
from kvtier.store.api.events import EventBatch, EventGap, EventKind

log = logging.getLogger(__name__)

_TIERS = {"gpu": Tier.GPU, "cpu": Tier.CPU, "disk": Tier.DISK}
# the store answered and refused the index, or could not prove who it is
_REFUSED = (ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED)


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
        verify: Authenticator | None = None,
    ) -> None:
        """``auth``: what the index presents to the store (an index credential), once the
        store proved a node credential known to ``verify``. A configured store followed with
        no credentials table (``verify`` None) is trusted as configured; a registered one
        always proves, or nothing is presented to it."""
        super().__init__(source.address, "store", index, config, dynamic)
        self.source = source
        self.auth = auth
        self.verify = verify
        self._client: StoreAdmin | None = None  # the store's surface for those who follow it
        self._node = ""  # the store's node id: our location name
        self._epoch = 0
        self._next = 0  # next store seq to read
        self._synced = False
        self._resume = True  # may read on from the index's cursor (until something went wrong)
        self._namespaces: set[bytes] = set()

    @property
    def location(self) -> str:
        return self._node

    @property
    def endpoint(self) -> str:
        return self.source.address

    def follow(self) -> None:
        while not self.halt.is_set():
            try:
                if self._client is None:
                    self._connect()
                # first: the backend lost the claim too, which is_writer then asks for again
                if self.take_reset():  # the backend lost our namespaces, location and entries
                    self._namespaces.clear()
                    self._synced = self._resume = False
                if not self.is_writer():
                    self.stats.state = SourceState.STANDBY
                    self._synced = False
                    assert self._client is not None
                    self._store_call(self._client.info)  # the source is alive: heard
                    self.heard()
                    self.check_standby()
                    self.halt.wait(self.config.probe_interval_s)
                    continue
                if not self._synced:
                    self._resync()
                self._read()
            except _StoreError as exc:
                self._disconnect()
                if exc.code in _REFUSED:  # it answered: not down, but not followed either
                    self.stats.state = SourceState.FAILED
                    self._failed(exc, refused=True)
                else:
                    self.stats.state = SourceState.UNREACHABLE
                    self._failed(exc)
            except KvtierError as exc:
                self.blind("the index refuses or fails its writes")
                self._failed(exc)

    def _failed(self, exc: KvtierError, refused: bool = False) -> None:
        self._synced = False
        if exc.code is ErrorCode.UNKNOWN_NAMESPACE:
            self._namespaces.clear()  # the backend forgot them: register them all again
        if exc.code is ErrorCode.UNKNOWN_LOCATION:
            self._namespaces.clear()  # re-register everything (see VllmFollower._flush)
            if self.dynamic:
                self.halt.set()
        self.stats.detail = exc.message
        log.debug("store %s: %s", self.source.address, exc)
        # refused: asking again at once would change nothing
        probe = self.config.probe_interval_s
        self.halt.wait(probe * 5 if refused else min(1.0, probe))

    def _connect(self) -> None:
        from kvtier.store.client.grpc import GrpcStoreClient

        # a configured address is the operator's; a registered one is anyone's: it proves
        verify = self.verify if self.dynamic or (self.verify and self.verify.enabled) else None
        client = self._store_call(
            GrpcStoreClient, self.source.address, timeout_s=5.0, auth=self.auth, verify=verify
        )
        try:
            proved = client.proved
            if self.dynamic and proved is not None and self.owner and proved.name != self.owner:
                raise _StoreError(
                    ErrorCode.PERMISSION_DENIED,
                    f"store {self.source.address} proved credential {proved.name!r}, not "
                    f"{self.owner!r} that registered it: not followed",
                )
            info = self._store_call(client.info)
            if self.dynamic and info.node_id != self.registered_as:
                raise _StoreError(
                    ErrorCode.PERMISSION_DENIED,
                    f"store {self.source.address} is node {info.node_id!r}, registered as "
                    f"{self.registered_as!r}: not followed",
                )
        except BaseException:
            client.close()
            raise
        self._client = client
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
        new = [ns for ns in namespaces if ns not in self._namespaces and self.writable(None, ns)]
        if new or not self._namespaces:
            if not self.may_register():
                return
            for ns in new:
                try:
                    self.index.register_namespace(ns)  # by id: the store validated them
                except KvtierError as exc:
                    if exc.code is not ErrorCode.LIMIT_EXCEEDED:
                        raise
                    self.refused_ns.add(ns)  # its chunks go unindexed (counted)
                    self.stats.rejected["namespace_limit"] += 1
                    continue
                self._namespaces.add(ns)
            self.index.register(
                Registration(
                    self._node,
                    LocationKind.NODE,
                    tuple(sorted(self._namespaces)),
                    endpoints={"store": self.source.address},
                    owner=self.owner,
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
            info = self.index.location(self._node)
            if (
                info is not None
                and info.cursor.epoch == self._epoch
                and info.cursor.seq
                and self._produced(info.cursor.seq)
            ):
                self._next = info.cursor.seq + 1
                self._synced = True
                self.unblind()
                return
        resets = self.index.backend_resets().resets  # before: a reset during this is owed again
        snap = self._store_call(self._client.snapshot)
        self._register(list(dict.fromkeys([*snap.chunks, *snap.disk_chunks])))
        tiers = {
            tier: {ns: keys for ns, keys in held.items() if ns not in self.refused_ns}
            for tier, held in ((Tier.CPU, snap.chunks), (Tier.DISK, snap.disk_chunks))
        }
        self.index.replace(self._node, tiers, epoch=self._epoch, seq=snap.seq)
        self._next = snap.seq + 1
        self._synced = True
        self.resynced_for = resets
        self.stats.resyncs += 1
        self.unblind()

    def _produced(self, seq: int) -> bool:
        """Has the store produced batch ``seq`` (it holds it, or has evicted it and goes on
        after it)? A cursor beyond its head was not written from this store's events."""
        assert self._client is not None
        got = self._store_call(self._client.read_events, seq, 1, 0)
        if isinstance(got, EventGap):
            return True  # evicted: reading on finds the gap and takes a snapshot
        return bool(got) and got[0].seq == seq

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
        if status is not ApplyStatus.APPLIED:
            # RESYNC, or DUPLICATE: the cursor is ahead of what this follower wrote (it alone
            # writes this location), so someone else moved it: the whole state, from a snapshot
            self.blind(f"the index answered {status.value} to its batches")
            self._synced = False
            return
        self._next = got[-1].seq + 1
        self.unblind()
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
        if self.refused_ns:  # not ours to write, or past the index's namespace bound
            ops = [op for op in ops if op.ns_id not in self.refused_ns]
        return ops

    def stop(self, timeout: float = 5.0) -> None:
        super().stop(timeout)
        if not self.is_alive():
            self._disconnect()
