"""The engine's hot path to a store on its own node, beside the gRPC client that holds it:
the store's control socket (``kvtier.store.client.control``) and its shared view of committed
chunks (``kvtier.store.client.view``), both adopted from the store's info and replaced when
the client re-attaches to a new incarnation.

Threading: ``adopt`` and ``close`` are the client's (under its re-attach); readers take
``control`` / ``known_miss`` from any thread: a view replaced under a reader stays mapped
until the reader lets go of it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Sequence

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.api import StoreInfo
from kvtier.store.api.types import LeaseStatus, LookupResult
from kvtier.store.client.control import ControlChannel
from kvtier.store.client.view import ChunkView, open_view
from kvtier.store.client.view_leases import ViewLeaser, open_leaser

MAX_VIEWED_NAMESPACES = 4096  # namespaces whose misses the view answers (the store's default)


class NodeLocalPath:
    """The control socket and the shared view of one store incarnation (none: gRPC only)."""

    def __init__(
        self, enabled: bool, token: str | None, timeout_s: float, view_leases: bool = True
    ) -> None:
        """``enabled``: use them when the store offers them (``store.fast_control``);
        ``token``: what the client presents on the socket; ``timeout_s``: one call's bound;
        ``view_leases``: lease hits from the store's lease region when it has one."""
        self._enabled = enabled
        self._view_leases = view_leases
        self._token = token
        self._timeout_s = timeout_s
        self.control: ControlChannel | None = None
        self._view: ChunkView | None = None
        self._view_epoch = 0
        self._view_map: mmap.mmap | None = None
        self._leaser: ViewLeaser | None = None  # the lease region, when the store has one
        self._registered: dict[bytes, int] = {}  # ns id -> the epoch it was registered at
        self.view_misses = 0  # lookups the view answered (a miss) without a call

    def adopt(self, info: StoreInfo) -> None:
        """Use ``info``'s control socket and view from now on (the previous incarnation's are
        closed): only a socket this process can open, i.e. a store on this node."""
        old = self.control
        if old is not None and old.path == info.control_socket:
            return
        self.control = None
        if old is not None:
            old.close()
        if self._enabled and info.control_socket and os.path.exists(info.control_socket):
            self.control = ControlChannel(info.control_socket, self._token, self._timeout_s)
        self._adopt_view(info)

    def _adopt_view(self, info: StoreInfo) -> None:
        self._drop_view()
        if self.control is None or not info.view_bytes:
            return
        try:
            view, mapped = open_view(info.segment_name, info.view_offset, info.view_bytes)
        except OSError:
            return  # not this node's store after all: lookups ask it
        if view.valid() and view.epoch == info.epoch:
            self._view, self._view_epoch, self._view_map = view, info.epoch, mapped
            if self._view_leases:
                with contextlib.suppress(OSError):
                    self._leaser = open_leaser(
                        info.segment_name, info.view_offset, info.view_bytes, view
                    )
        else:
            del view
            _unmap(mapped)

    def registered(self, ns_id: bytes, epoch: int) -> None:
        """The client registered ``ns_id`` at incarnation ``epoch``: the view may answer its
        misses (a namespace not registered here is the store's to answer, UNKNOWN_NAMESPACE
        and tenant gate included)."""
        if len(self._registered) >= MAX_VIEWED_NAMESPACES:
            self._registered.clear()  # asked of the store until registered again
        self._registered[ns_id] = epoch

    def known_miss(
        self, ns_id: bytes, keys: Sequence[bytes], epoch: int, with_disk: bool = False
    ) -> bool:
        """True when the view of incarnation ``epoch`` (the client's) says the lookup misses
        (``with_disk``: on the store's disk too, which only a view covering it can say)."""
        view = self._view
        if view is None or self._view_epoch != epoch or self._registered.get(ns_id) != epoch:
            return False
        if with_disk and not view.covers_disk:
            return False
        if not view.misses(ns_id, keys):
            return False
        self.view_misses += 1
        return True

    def view_lease(
        self, ns_id: bytes, keys: Sequence[bytes], epoch: int, session: int, ttl_s: float
    ) -> LookupResult | None:
        """A leased lookup answered from the view's lease region of incarnation ``epoch``
        (pins taken under ``session``), or None: ask the store."""
        view, leaser = self._view, self._leaser
        if view is None or leaser is None or self._view_epoch != epoch:
            return None
        if self._registered.get(ns_id) != epoch or len(keys) > int(view.words[4]):
            return None
        if time.monotonic_ns() - int(view.words[5]) > int(view.words[6]):
            return None  # the store has not said it is alive lately: ask it
        return leaser.lookup(ns_id, keys, session, ttl_s)

    def release_view_leases(self, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        leaser = self._leaser
        if leaser is None:  # the store restarted since: what was read under them is suspect
            return [LeaseStatus.EXPIRED] * len(lease_ids)
        return leaser.release(lease_ids)

    def renew_view_lease(self, lease_id: int, ttl_s: float) -> float:
        leaser = self._leaser
        if leaser is None:
            raise KvtierError(ErrorCode.LEASE_EXPIRED, "the store restarted since this lease")
        return leaser.renew(lease_id, ttl_s)

    @property
    def leases_here(self) -> bool:
        """The store has a lease region this client mapped."""
        return self._leaser is not None

    @property
    def view_hits(self) -> int:
        return self._leaser.hits if self._leaser is not None else 0

    def _drop_view(self) -> None:
        leaser, self._leaser = self._leaser, None
        if leaser is not None:
            leaser.close()
        self._view, view_map, self._view_map = None, self._view_map, None
        if view_map is not None:
            _unmap(view_map)

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        self._drop_view()


def _unmap(mapped: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a reader still holds it: unmapped after it
        mapped.close()
