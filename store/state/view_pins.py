"""Read leases the engines take without asking the store: what the state machine needs of them.

An engine on the node may pin a committed chunk by writing its serial into its session's row
of a pin table in shared memory (``kvtier.store.client.view_leases`` says how;
``kvtier.store.client.pin_table`` implements this). The store cannot see a pin being taken,
only pins already taken, and only while it holds the table's lock (``begin``): so every
operation that may free a committed chunk's pages runs inside ``begin() … end()``
(``StoreCore._exclusive``) and asks ``pinned`` first:

- eviction skips a pinned chunk, like one a store lease pins;
- a chunk deleted or cleared while pinned leaves the table and the engines' view at once, but
  keeps its pages (``doomed``, held in ``PageBook.view_held``) until no pin names it;
  ``holding`` is re-read by the reaper (no lock needed: a chunk out of the view cannot gain a
  pin, only lose one), and a session that ends takes its pins with it.

When an engine holds the lock too long (stopped mid-read), the section runs without it and
``pinned`` answers True for every chunk: nothing is evicted, a deleted chunk is held until a
later read of the pins clears it (after ``HOLD_MIN_S``, longer than any store-buffer delay
between an engine's pin and the store's read). Safe, and at worst an allocation that finds
no room.

Threading: called by ``StoreCore`` under its lock only.
"""

from __future__ import annotations

from typing import Protocol

HOLD_MIN_S = 0.05  # a held chunk's pins are re-read no sooner than this after it was unlinked


class ViewPins(Protocol):
    def begin(self) -> None:
        """Enter a section (nested: counted); the outermost takes the pin table's lock and
        reads every pin."""

    def end(self) -> None:
        """Leave a section; the outermost releases the lock."""

    def pinned(self, serial: int) -> bool:
        """The chunk ``serial`` may be pinned (True also whenever that is not known)."""

    def holding(self) -> set[int]:
        """The serials pinned now."""

    def expire(self, lifetime_s: float) -> None:
        """End the pins held longer than ``lifetime_s`` (``store.max_lease_lifetime_s``): no
        lease lives past it, an engine's own neither."""

    def take_touches(self) -> list[int]:
        """The serials engines hit since the last call (what the store counts as uses)."""

    def has_row(self, session: int) -> bool:
        """``session`` has a row (a read without the store's lock: a dict's membership)."""

    def assign(self, session: int) -> None:
        """Give ``session`` a row, when it has none and one is free (else its leases go
        through the store)."""

    def session_ended(self, session: int) -> None:
        """Clear ``session``'s row: its pins end."""
