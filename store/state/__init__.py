"""The store's state machine: ``StoreCore`` (``core``) and the components it is composed of:
which chunks sit on which pages (``pages``), who holds them (``leases``, ``sessions``), what
each tenant may hold (``quotas``), the namespaces (``namespaces``), chunks waiting for their
checksum (``checksums``), per-request bounds (``limits``) and what happened, in order
(``eventlog``); and what works on those components for it: how leases and sessions end
(``lifetimes``), the store's own work on chunks (``upkeep``), its stats, snapshot and
invariants (``report``).

Everything here runs under ``StoreCore``'s one lock and does no I/O. May import:
``kvtier.store.api``, ``kvtier.store.pool``, ``kvtier.core``.
"""
