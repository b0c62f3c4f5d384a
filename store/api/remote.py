"""What a fetch from a peer store answers (shared by the store API, gRPC and the fetcher)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FetchStatus(enum.StrEnum):
    """Why the local prefix ends where it does (OK: it covers every key asked for).

    Everything but OK is a load error for the keys from ``FetchResult.local`` on: the caller
    recomputes them. HOLDER_MISS also means the index entry that named the holder is stale.
    """

    OK = "ok"
    HOLDER_MISS = "holder_miss"  # the holder does not hold the next key (never had / evicted)
    PEER_UNREACHABLE = "peer_unreachable"  # holder store or its transfer engine not answering
    TIMEOUT = "timeout"  # the fetch deadline passed (holder stalled or too slow)
    TRANSFER_FAILED = "transfer_failed"  # the engine failed the read (holder died mid-transfer)
    CHECKSUM_MISMATCH = "checksum_mismatch"  # bytes arrived but not the holder's checksum
    REFUSED = "refused"  # the holder answered with an error, or with a location we reject
    NO_SPACE = "no_space"  # this pool is full of pinned / being-written chunks
    BUSY = "busy"  # another writer is storing the next key here right now: ask again soon


@dataclass(frozen=True, slots=True)
class FetchResult:
    status: FetchStatus
    local: int  # the first ``local`` keys asked for are now committed in this store
    fetched: int  # chunks moved from the holder and committed by this call
    bytes: int  # bytes moved and committed by this call
    holder_hits: int  # the first ``holder_hits`` keys were held (and leased) at the holder
    checksum_mismatches: int = 0
    present: tuple[bool, ...] = ()  # per key: committed here now (also past the prefix)
    message: str = ""
    # Seconds spent in each step the fetch reached ("holder_lease", "allocate", "transfer",
    # "commit"): for the store's metrics, so a slow remote hit says where its time went. Not
    # sent to the caller.
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status is FetchStatus.OK
