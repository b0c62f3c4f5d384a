"""Following a vLLM engine's KV cache events over ZMQ (``--kv-events-config``).

Sockets: a SUB connected to the engine's PUB (``[topic, seq, payload]``, seq from 0 per
publisher) and a DEALER to its ROUTER replay socket (send ``[b"", start_seq]``; receive every
buffered batch ``>= start_seq``, then an end marker).

What can go wrong, and what this does:

- *The index starts after the engine* (or the SUB joined late and missed batches): it asks
  for a replay from 0 at start, so it learns whatever the engine still buffers; it waits for
  that before writing, so it never wipes a (Redis) index with a half-built state.
- *A gap* in the live sequence: replay from the first missing batch; live batches that
  arrive meanwhile wait, in order. What the engine no longer buffers is lost (counted); the
  index then gets the whole state again (``replace``), which is the best we know.
- *A lost tail* (the last batches dropped, nothing after them to reveal it) and *liveness*:
  every probe interval the follower asks a replay from the last batch it applied. The answer
  proves the engine alive (a heartbeat), carries any batch it missed, and tells a restarted
  engine from the same one: the same incarnation still has that batch with the same
  timestamp.
- *The engine restarted*: sequence numbers went back, or the probe found a different batch
  (or none) where ours was. Forget the mapper, replay from 0, replace.
- *Malformed batches or events*: skipped and counted, the rest of the batch applies.
- *The index's backend lost its data* (``Follower.take_reset``): register again and replace
  with the mapper's state, which is the engine's as far as we learned it (nothing to replay).

Threading: everything here runs on the follower's own thread (ZMQ sockets are not
thread-safe); only ``stats`` is read from elsewhere.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from kvtier.core.config.index import IndexConfig, VllmSource
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.index.api import ApplyStatus, ChunkIndex, HeartbeatStatus, LocationKind, Registration
from kvtier.index.ingest.follower import Follower, SourceState
from kvtier.index.ingest.vllm_blocks import BlockMapper
from kvtier.index.ingest.vllm_wire import (
    END_SEQ,
    BlockStored,
    EventBatchDecoder,
    RawBatch,
)

log = logging.getLogger(__name__)

MAX_HELD = 200_000  # live batches kept while a replay is answered
DRAIN = 2048  # messages handled per poll round before writing


@dataclass
class _Replay:
    start: int
    deadline: float
    reason: str  # catch_up | gap | probe
    anchor_ts: float | None  # probe: batch `start` must still carry this timestamp
    got: list[tuple[int, bytes]] = field(default_factory=list)


def _new_epoch() -> int:
    return random.SystemRandom().randrange(1, 1 << 62)


class VllmFollower(Follower):
    def __init__(
        self,
        source: VllmSource,
        index: ChunkIndex,
        config: IndexConfig,
        ctx: zmq.Context,
        dynamic: bool = False,
    ) -> None:
        super().__init__(source.instance, "vllm", index, config, dynamic)
        self.source = source
        self._ctx = ctx
        self.mapper = BlockMapper(source.namespaces)
        self._decoder = EventBatchDecoder()
        self._header = msgspec.msgpack.Decoder(RawBatch)
        self._epoch = _new_epoch()
        self._next: int | None = None  # next engine seq expected
        self._last_ts: float | None = None  # timestamp of batch _next - 1
        self._written = 0  # index cursor: 1-based seq of the newest batch written
        self._synced = False  # the index holds the mapper's state up to _written
        self._caught_up = source.replay_endpoint is None  # initial replay answered (or none)
        self._replay: _Replay | None = None
        self._replay_buffers = False  # some replay returned batches: it keeps history
        self._peer_lost = False  # the SUB lost its connection: the engine may have restarted
        self._held: list[tuple[int, bytes]] = []
        self._dealer: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._namespaces = list(source.namespaces)  # and derived ones (LoRA, cache salts)
        self._registered = False

    @property
    def location(self) -> str:
        return self.source.instance

    @property
    def endpoint(self) -> str:
        return self.source.endpoint

    # -- the loop -----------------------------------------------------------------------------

    def follow(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 1_000_000)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.endpoint)
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        self.stats.state = SourceState.CATCHING_UP
        try:  # known at once (queries may name the namespace before anything is learned)
            self._register()
        except KvtierError as exc:
            self.stats.detail = f"index: {exc.message}"  # _flush retries
        if not self._ask_replay(0, "catch_up"):
            self._caught_up = True
        next_probe = time.monotonic() + self.config.probe_interval_s
        try:
            while not self.halt.is_set():
                ready = dict(self._poller.poll(100))
                if sub in ready:
                    for _ in range(DRAIN):
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_live(frames)
                if monitor in ready:
                    while monitor.poll(0):
                        monitor.recv_multipart()
                        self._peer_lost = True
                if self._dealer is not None and self._dealer in ready:
                    for _ in range(DRAIN):
                        try:
                            frames = self._dealer.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_replay(frames)
                        if self._dealer is None:
                            break
                now = time.monotonic()
                if self._replay is not None and now > self._replay.deadline:
                    self._replay_failed()
                if now >= next_probe:
                    next_probe = now + self.config.probe_interval_s
                    self._probe()
                self._flush()
        finally:
            self._poller.unregister(sub)
            self._poller.unregister(monitor)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            self._close_dealer()

    # -- live batches -------------------------------------------------------------------------

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.rejected["bad_frames"] += 1
            return
        self.heard()
        seq = int.from_bytes(frames[1], "big")
        if self._replay is not None:
            if len(self._held) < MAX_HELD:
                self._held.append((seq, frames[2]))
            return
        self._take(seq, frames[2], may_replay=True)

    def _take(self, seq: int, payload: bytes, may_replay: bool) -> None:
        """Apply batch ``seq`` to the mapper if it is the next one (see the module doc)."""
        if self._next is not None and seq < self._next:
            ts = self._timestamp(payload)
            if ts is not None and self._last_ts is not None and ts > self._last_ts:
                log.warning("%s: sequence went back to %d: engine restarted", self.location, seq)
                self._restart()
                if self._ask_replay(0, "catch_up"):
                    self._held.append((seq, payload))
                else:
                    self._take(seq, payload, may_replay=False)
                return
            self.stats.rejected["duplicate"] += 1
            return
        if self._next is None:
            if seq > 0:  # the engine no longer buffers its first batches
                self.stats.gaps_lost += seq
            self._next = seq
        elif seq > self._next:
            if may_replay and self._ask_replay(self._next, "gap"):
                self._held.append((seq, payload))
                return
            log.warning("%s: batches %d..%d lost", self.location, self._next, seq - 1)
            self.stats.gaps_lost += seq - self._next
            self._synced = False  # what the index holds may have drifted: send it all
            self._next = seq
        try:
            ts, events, bad = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.stats.rejected["malformed_batch"] += 1
            self._next = seq + 1
            self._last_ts = None
            return
        if bad:
            self.stats.rejected["malformed_event"] += bad
        self._next = seq + 1
        self._last_ts = ts
        self.stats.batches += 1
        for ev in events:
            kind = type(ev)
            self.stats.events[kind.__name__] += 1
            if kind is BlockStored:
                self.stats.blocks += len(ev.block_hashes)  # type: ignore[union-attr]
        try:
            self.mapper.feed(events)
        except Exception:  # pragma: no cover - a mapper bug must not stop the follower
            log.exception("%s: batch %d could not be mapped", self.location, seq)
            self.stats.rejected["unmappable"] += 1
            self._synced = False

    def _timestamp(self, payload: bytes) -> float | None:
        try:
            return self._header.decode(payload).ts
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    def _restart(self) -> None:
        self.stats.restarts += 1
        self.mapper.reset()
        self._epoch = _new_epoch()
        self._next = None
        self._last_ts = None
        self._synced = False
        self._peer_lost = False
        self._caught_up = self.source.replay_endpoint is None

    # -- replay -------------------------------------------------------------------------------

    def _ask_replay(self, start: int, reason: str) -> bool:
        """Ask the engine for its buffered batches from ``start`` (False: cannot ask)."""
        if self.source.replay_endpoint is None:
            return False
        if self._replay is not None:
            return True  # one at a time: the pending one covers it or the next will
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.source.replay_endpoint)
            self._poller.register(self._dealer, zmq.POLLIN)
        try:
            self._dealer.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.Again:
            return False
        anchor = self._last_ts if reason == "probe" else None
        deadline = time.monotonic() + self.config.replay_timeout_s
        self._replay = _Replay(start, deadline, reason, anchor)
        return True

    def _on_replay(self, frames: list[bytes]) -> None:
        replay = self._replay
        if replay is None or len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
            self.stats.rejected["stray_replay"] += 1
            return
        if frames[2] == END_SEQ:
            self._replay_done()
        else:
            replay.got.append((int.from_bytes(frames[2], "big"), frames[3]))

    def _replay_done(self) -> None:
        replay = self._replay
        assert replay is not None
        self._replay = None
        self.heard()
        batches = sorted(replay.got)
        self._replay_buffers |= bool(batches)
        if replay.reason == "probe" and replay.anchor_ts is not None:
            # is this still the engine we knew? it would still have our last batch, as it was
            if batches and batches[0][0] == replay.start:
                same = self._timestamp(batches[0][1]) == replay.anchor_ts
                batches = batches[1:]
            elif batches:  # our batch left its buffer, newer ones are there: the same engine
                same = batches[0][0] > replay.start
            else:  # nothing at or after our last batch: a new engine, unless it keeps none
                same = not (self._peer_lost or self._replay_buffers)
            if same:
                self._peer_lost = False
            else:
                log.warning("%s: engine restarted (its replay no longer matches)", self.location)
                self._restart()
                if self._ask_replay(0, "catch_up"):
                    return
        lost = self.stats.gaps_lost
        for seq, payload in batches:
            self._take(seq, payload, may_replay=False)
        if replay.reason == "gap" and self.stats.gaps_lost == lost:
            self.stats.gaps_recovered += 1
        self._caught_up = True
        held, self._held = sorted(self._held), []
        for i, (seq, payload) in enumerate(held):
            if self._replay is not None:  # a restart asked for a new catch-up
                self._held.extend(held[i:])
                break
            self._take(seq, payload, may_replay=False)

    def _replay_failed(self) -> None:
        """No end marker in time: the engine is gone or has no replay socket there."""
        self._replay = None
        self._close_dealer()  # late answers must not be taken for the next request's
        self.stats.state = SourceState.UNREACHABLE
        self.stats.detail = f"no replay answer from {self.source.replay_endpoint}"
        self._caught_up = True
        held, self._held = sorted(self._held), []
        for seq, payload in held:
            self._take(seq, payload, may_replay=False)

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._poller.unregister(self._dealer)
            self._dealer.close(linger=0)
            self._dealer = None

    def _probe(self) -> None:
        """Liveness, lost tails and restarts (see the module doc)."""
        if self._replay is not None or self.source.replay_endpoint is None:
            return
        if self._next and self._last_ts is not None:
            self._ask_replay(self._next - 1, "probe")
        else:
            self._ask_replay(self._next or 0, "catch_up" if self._next is None else "gap")

    # -- writing ------------------------------------------------------------------------------

    def _registration(self) -> Registration:
        endpoints = {"events": self.source.endpoint, "topic": self.source.topic}
        if self.source.replay_endpoint:
            endpoints["replay"] = self.source.replay_endpoint
        if self.source.api:  # routers find the instance by it: keep it across re-registrations
            endpoints["api"] = self.source.api
        return Registration(
            self.location,
            LocationKind.INSTANCE,
            tuple(ns.root_key() for ns in self._namespaces),
            node=self.source.node,
            endpoints=endpoints,
            owner=self.owner,
        )

    def _register(self) -> None:
        """(Re-)register every namespace and the instance: also after the backend lost them.
        Namespaces its registrant may not write (another tenant's salt in the engine's
        events), or past the index's bound, are left out, and their chunks unindexed."""
        self._namespaces = [
            ns
            for ns in [*self._namespaces, *self.mapper.new_namespaces]
            if self.writable(ns, ns.root_key())
        ]
        self.mapper.new_namespaces.clear()
        if not self.may_register():
            return
        for ns in list(self._namespaces):
            try:
                self.index.register_namespace(ns)
            except KvtierError as exc:
                if exc.code is not ErrorCode.LIMIT_EXCEEDED:
                    raise
                self._namespaces.remove(ns)
                self.refused_ns.add(ns.root_key())
                self.stats.rejected["namespace_limit"] += 1
        self.index.register(self._registration())
        self._registered = True

    def _holdings(self) -> dict:
        held = self.mapper.holdings()
        if self.refused_ns:
            for by_ns in held.values():
                for ns in self.refused_ns.intersection(by_ns):
                    del by_ns[ns]
        return held

    def _flush(self) -> None:
        ops = self.mapper.take_ops()
        if not self._caught_up:
            return  # never write a half-learned state over what the index holds
        if time.monotonic() < self.retry_at:
            self._synced = False
            return
        try:
            if self.take_reset():  # the backend lost our namespaces, registration, entries
                self._registered = self._synced = False
            if not self._registered or self.mapper.new_namespaces:
                self._register()
                if self.halt.is_set():  # its registrant unregistered it: stop here
                    return
            if self.refused_ns:  # not its registrant's to write, or past the bound
                ops = [op for op in ops if op.ns_id not in self.refused_ns]
            if not self.is_writer():
                self._synced = False  # taking over later starts with a whole-state write
                self.stats.state = SourceState.STANDBY
                self.beat()
                self.check_standby()
                return
            upto = self._next or 0  # 1-based seq of the newest batch the mapper applied
            if self._synced and ops:
                if upto <= self._written:  # pragma: no cover - ops come with new batches
                    self._synced = False
                else:
                    status = self.index.apply(
                        self.location, ops, epoch=self._epoch, seq_from=self._written + 1,
                        seq_to=upto,
                    )  # fmt: skip
                    if status is ApplyStatus.APPLIED:
                        self._written = upto
                        self.unblind()
                    else:
                        # RESYNC, or DUPLICATE: batches this follower never sent are in the
                        # cursor (it alone writes this location): someone else moved it
                        self.blind(f"the index answered {status.value} to its batches")
                        self._synced = False
            if not self._synced:
                resets = self.index.backend_resets().resets  # a reset during it is owed again
                self.index.replace(self.location, self._holdings(), epoch=self._epoch, seq=upto)
                self.resynced_for = resets
                self._synced = True
                self._written = upto
                self.stats.resyncs += 1
                self.unblind()
            if self.beat() is HeartbeatStatus.RESYNC:
                self._synced = False
            if self.stats.state is not SourceState.UNREACHABLE:
                self.stats.state = SourceState.LIVE
                self.stats.detail = ""
        except KvtierError as exc:
            self._synced = False
            self.blind("the index refuses or fails its writes")
            self.retry_at = time.monotonic() + min(1.0, self.config.probe_interval_s)
            if exc.code is ErrorCode.UNKNOWN_LOCATION:
                # forgotten: unregistered, or Redis lost it. A source of our configuration
                # registers again; one we follow for its registrant stops (the registrant
                # registers again if it still wants it followed).
                self._registered = False
                if self.dynamic:
                    self.halt.set()
            self.stats.detail = f"index: {exc.message}"
            log.debug("%s: %s", self.location, exc)
