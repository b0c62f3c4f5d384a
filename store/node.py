"""A node store: the pool segment plus the state machine, usable in-process or behind gRPC.

``NodeStore`` is the store: the pool's segment, the state machine (``core``, a ``StoreCore``),
the remote tier and the background threads (reaper, checksummer). Embedded mode (no store
address configured) uses it directly in the connector's process, through the two surfaces of
the store's API (``StoreClient``, ``StoreAdmin``), whose state-machine calls it hands to
``core``. ``kvtier store serve`` puts it behind gRPC/HTTP, whose handlers call ``core`` (and
the remote tier's ``fetcher``) themselves.

Remote tier (``store.remote.enabled``): the pool is registered with a transfer engine, whose
address ``info()`` publishes; peers read chunks leased with ``lease_for_peer``, and ``fetch``
pulls chunks from a peer (``kvtier.tiers.remote``).

Crash hygiene (a lock file per store in ``store.run_dir``, naming its segment, so the next
store on the node removes a dead one's): ``kvtier.store.run_dir``.

Sessions: clients may open sessions (``open_session``) and create leases under them; the
reaper thread ends a session without heartbeat for ``store.session_timeout_s`` together with
its leases (``kvtier.store.state.sessions``). It also retires namespaces left empty and unused
(``kvtier.store.state.namespaces``), so that the count of namespaces stays low.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier import __version__
from kvtier.core.auth import Authenticator
from kvtier.core.config import StoreConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace
from kvtier.core.rpc import ClientAuth
from kvtier.store.api import StoreAdmin, StoreClient, StoreInfo
from kvtier.store.api.events import EventBatch, EventGap
from kvtier.store.api.remote import FetchResult
from kvtier.store.api.types import AllocateResult, LeaseStatus, LookupResult, Snapshot
from kvtier.store.client.control import socket_path
from kvtier.store.client.shm import SHM_DIR, SharedSegment, checksum_views
from kvtier.store.disk.backend import DiskBackend
from kvtier.store.pool.watchdog import start_watchdog, stop_watchdog
from kvtier.store.run_dir import LOCK_SUFFIX, acquire_lock, cleanup_stale_segments, prepare_run_dir
from kvtier.store.shared_view import SharedView
from kvtier.store.state.core import StoreCore
from kvtier.store.state.limits import StoreLimits, tenant_limits

if TYPE_CHECKING:
    from kvtier.store.remote.service import RemoteTier

log = logging.getLogger(__name__)


class NodeStore(StoreClient, StoreAdmin):
    """The store itself. Thread-safe; ``close()`` releases the shared memory."""

    def __init__(
        self,
        config: StoreConfig,
        instance: str | None = None,
        peer_auth: ClientAuth | None = None,
        peer_verify: Authenticator | None = None,
        index_address: str | None = None,
    ) -> None:
        """``instance`` names this store among others on the node (default: the gRPC port for
        a served store, the pid for an embedded one). Remote tier: ``peer_auth`` is what it
        presents to peer stores, ``peer_verify`` checks their proof of a node credential
        first, and the node stores the index at ``index_address`` lists are peers besides
        ``store.remote.peers`` (``kvtier.store.remote.directory``)."""
        self.config = config
        self.epoch = secrets.randbits(63) or 1
        instance = instance or f"pid{os.getpid()}"
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{config.node_id}-{instance}")
        self.segment_name = f"kvtier-{safe}-{self.epoch:016x}"
        pool = config.pool
        self.core = StoreCore(  # first: a bad limit (tenants) fails before anything exists
            node_id=config.node_id,
            epoch=self.epoch,
            capacity_bytes=int(pool.capacity),
            page_size=int(pool.page_size),
            eviction=pool.eviction,
            lease_ttl_s=config.lease_ttl_s,
            write_ttl_s=config.write_ttl_s,
            max_lease_ttl_s=config.max_lease_ttl_s,
            event_buffer=config.event_buffer,
            limits=StoreLimits.from_config(config),
        )
        run_dir = prepare_run_dir(Path(config.run_dir))
        cleanup_stale_segments(run_dir)
        self._lock_path = run_dir / f"{safe}{LOCK_SUFFIX}"
        self._lock_fd = acquire_lock(self._lock_path, self.segment_name)
        # what engines read without calling the store (kvtier.store.shared_view), after the pool
        self.view_offset = -(-int(pool.capacity) // 4096) * 4096 if config.fast_control else 0
        self.view_bytes = 0
        if config.fast_control:
            self.view_bytes = SharedView.nbytes(
                config, self.core.capacity_bytes, self.core.page_size
            )
        try:
            self.segment = SharedSegment.create(
                self.segment_name,
                (self.view_offset + self.view_bytes) or int(pool.capacity),
                prefault=pool.prefault,
            )
        except BaseException:
            self._release_lock()
            raise
        self._view: SharedView | None = None
        if self.view_bytes:
            self._view = SharedView(
                config, self.core, self.segment, self.view_offset, 3 * self._reap_period()
            )
        # what a crash leaves is removed by the watchdog: the pool, the lock file and the
        # control socket a service may serve for this incarnation (store.server.control)
        control = socket_path(run_dir, self.epoch)
        self._watchdog = start_watchdog(
            [SHM_DIR / self.segment_name, self._lock_path, *([control] if control else [])]
        )
        self.remote: RemoteTier | None = None
        if config.remote.enabled:
            from kvtier.store.remote.service import RemoteTier

            try:
                self.remote = RemoteTier(
                    self.core,
                    self.segment,
                    config.remote,
                    peer_auth=peer_auth,
                    peer_verify=peer_verify,
                    index_address=index_address,
                )
            except BaseException:
                self.segment.close()
                self.segment.unlink()
                self._release_lock()
                raise
        self.disk: DiskBackend | None = None
        if config.disk.enabled:
            try:
                self.disk = DiskBackend(
                    self.core, self.segment, config.disk, tenant_limits(config, disk=True)
                )
                if self._view is not None:  # the files found on disk, before engines map it
                    self._view.add_disk_held(self.disk.catalog.held())
            except BaseException:
                if self.remote is not None:
                    self.remote.close()
                self.segment.close()
                self.segment.unlink()
                self._release_lock()
                raise
        self.transfer_address = self.remote.address if self.remote else ""
        self.control_socket = ""  # set by the service serving one (store.server.control)
        # its message counts, set with it (``ControlServer.stats``)
        self.control_stats: Callable[[], dict[str, int]] | None = None
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="kvtier-reaper", daemon=True)
        self._reaper.start()
        self._checksum_wake = threading.Event()
        # checksum chunks committed without one now: loads that verify wait for it
        self.core.checksums.on_waiting = self._checksum_wake.set
        self._checksummer = threading.Thread(
            target=self._checksum_loop, name="kvtier-checksum", daemon=True
        )
        self._checksummer.start()
        log.info(
            "store %s epoch %016x: %d-byte pool in /dev/shm/%s",
            config.node_id,
            self.epoch,
            self.core.capacity_bytes,
            self.segment_name,
        )

    # -- StoreClient and StoreAdmin: the state machine's calls go to ``core`` -----------------

    def info(self) -> StoreInfo:
        return StoreInfo(
            node_id=self.config.node_id,
            epoch=self.epoch,
            segment_name=self.segment_name,
            segment_size=self.segment.size,
            page_size=self.core.page_size,
            version=__version__,
            transfer_address=self.transfer_address,
            transfer_base=self.remote.base_address if self.remote else 0,
            lease_ttl_s=self.config.lease_ttl_s,
            session_timeout_s=self.config.session_timeout_s,
            control_socket=self.control_socket,
            view_offset=self.view_offset,
            view_bytes=self.view_bytes,
        )

    def local_segment(self) -> SharedSegment:
        return self.segment

    def register_namespace(self, namespace: Namespace, chunk_bytes: int) -> bytes:
        return self.core.register_namespace(namespace, chunk_bytes)

    def lookup(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        lease_ttl_s: float | None = None,
        *,
        session: int = 0,
    ) -> LookupResult:
        return self.core.lookup(ns_id, keys, lease_ttl_s, session=session)

    def allocate(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        ttl_s: float | None = None,
        *,
        session: int = 0,
    ) -> AllocateResult:
        return self.core.allocate(ns_id, keys, sizes, ttl_s, session=session)

    def commit(
        self,
        lease_id: int,
        keys: Sequence[bytes] | None,
        checksums: Sequence[int],
        *,
        as_ns_id: bytes = b"",
        as_keys: Sequence[bytes] | None = None,
    ) -> int:
        return self.core.commit(lease_id, keys, checksums, as_ns_id=as_ns_id, as_keys=as_keys)

    def abort(self, lease_id: int, keys: Sequence[bytes] | None = None) -> int:
        return self.core.abort(lease_id, keys)

    def release(self, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        return self.core.release(lease_ids)

    def renew(self, lease_id: int, ttl_s: float | None = None) -> float:
        return self.core.renew(lease_id, ttl_s)

    def open_session(self) -> int:
        return self.core.open_session()

    def heartbeat(self, session: int) -> bool:
        return self.core.heartbeat(session)

    def close_session(self, session: int) -> int:
        return self.core.close_session(session)

    def delete(self, ns_id: bytes, keys: Sequence[bytes]) -> int:
        return self.core.delete(ns_id, keys)

    def clear(self) -> int:
        if self.disk is not None:
            self.disk.clear()  # the CLEARED event core.clear logs covers the disk too
        return self.core.clear()

    def stats(self) -> dict[str, int | float | str]:
        stats = self.core.stats()
        if self.remote is not None:
            stats.update(self.remote.stats())
        if self.disk is not None:
            stats.update(self.disk.stats())
        if self._view is not None:
            stats.update(self._view.stats())
        if self.control_stats is not None:
            stats.update(self.control_stats())
        return stats

    def snapshot(self) -> Snapshot:
        snap = self.core.snapshot()
        if self.disk is not None:
            # read after the pool's: a disk change is in the catalog before its event is
            # logged, so everything up to ``snap.seq`` is in what is read here
            snap.disk_chunks.update(self.disk.catalog.held())
        return snap

    def read_events(
        self, from_seq: int, max_batches: int = 256, timeout: float | None = None
    ) -> list[EventBatch] | EventGap:
        if self._closed.is_set():
            raise KvtierError(ErrorCode.UNAVAILABLE, "store is shut down")
        return self.core.events.read(from_seq, max_batches, timeout)

    # -- remote tier -------------------------------------------------------------------------

    def lease_for_peer(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        lease_ttl_s: float | None = None,
        timeout_s: float | None = None,
        *,
        session: int = 0,
    ) -> LookupResult:
        self.core.limits.check_batch(len(keys))
        # Under the peer's session: it ends with it, and counts against its bounds.
        return self._remote_tier().fetcher.lease_for_peer(ns_id, keys, lease_ttl_s, session)

    def fetch(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        holder: str,
        timeout_s: float | None = None,
    ) -> FetchResult:
        self.core.limits.check_batch(len(keys))
        return self._remote_tier().fetcher.fetch(ns_id, keys, holder, timeout_s)

    def stage_from_disk(self, ns_id: bytes, keys: Sequence[bytes], timeout_s: float) -> FetchResult:
        self.core.limits.check_batch(len(keys))
        if self.disk is None:
            raise disk_tier_off(self.config.node_id)
        return self.disk.stage(ns_id, keys, timeout_s)

    def start_remote(self, grpc_address: str) -> None:
        """Called once the store serves gRPC at ``grpc_address`` (what peers fetch from)."""
        if self.remote is not None:
            self.remote.start_demotion(grpc_address)

    def _remote_tier(self) -> RemoteTier:
        if self.remote is None:
            raise remote_tier_off(self.config.node_id)
        return self.remote

    # -- lifetime ----------------------------------------------------------------------------

    def _reap_period(self) -> float:
        config = self.config
        # Often enough that a dead client's session (and its pins) ends within ~1.25 timeouts.
        return max(
            0.05,
            min(1.0, config.lease_ttl_s / 4, config.write_ttl_s / 4, config.session_timeout_s / 4),
        )

    def _reap_loop(self) -> None:
        period = self._reap_period()
        while not self._closed.wait(period):
            self.core.reap()
            if self._view is not None:
                self._view.alive()

    def _checksum_loop(self) -> None:
        """Checksum chunks committed without one. xxhash releases the GIL, so this runs beside
        the request threads (and beside vLLM's, when embedded)."""
        while not self._closed.is_set():
            self._checksum_wake.wait(0.5)
            self._checksum_wake.clear()
            while not self._closed.is_set():
                batch = self.core.upkeep.take_unsummed()
                if not batch:
                    break
                done = []
                for entry, location in batch:
                    try:
                        done.append((entry, checksum_views(self.segment.views(location.extents))))
                    except ValueError:  # segment unmapped under us: shutting down
                        done.append((entry, 0))
                self.core.upkeep.finish_checksums(done)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """Unlink the pool segment and the lock file. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.core.events.close()
        if self._view is not None:
            self._view.close()
        if self.remote is not None:
            self.remote.close()  # before the pool is unmapped: peers must not read it after
        if self.disk is not None:
            self.disk.close()  # before the pool is unmapped: its threads read and write it
        self.segment.close()
        self.segment.unlink()
        self._release_lock()
        stop_watchdog(self._watchdog)
        log.info("store %s epoch %016x closed", self.config.node_id, self.epoch)

    def _release_lock(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._lock_path.unlink()
        os.close(self._lock_fd)


def disk_tier_off(node_id: str) -> KvtierError:
    return KvtierError(
        ErrorCode.UNAVAILABLE, f"store {node_id} runs without the disk tier (store.disk.enabled)"
    )


def remote_tier_off(node_id: str) -> KvtierError:
    """What a store without the remote tier answers a fetch or a peer's lease."""
    return KvtierError(
        ErrorCode.UNAVAILABLE,
        f"store {node_id} runs without the remote tier (store.remote.enabled = false)",
    )
