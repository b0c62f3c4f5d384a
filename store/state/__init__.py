"""The store's state machine: which chunks the pool holds (``core``), on which pages
(``pages``), who holds them (``leases``, ``sessions``), what each tenant may hold (``quotas``),
per-request bounds (``limits``) and what happened, in order (``eventlog``).

Everything here runs under ``StoreCore``'s one lock and does no I/O. May import:
``kvtier.store.api``, ``kvtier.store.pool``, ``kvtier.core``.
"""
