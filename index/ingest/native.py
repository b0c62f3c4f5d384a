"""The C extension of ingest (``_ingest_c.c``: a batch's BlockStored events decoded into the
bytes chunk keys hash, a stored chunk's block records built without a Python loop), or None
for each where it was not built (a machine without a C compiler: ``setup.py`` builds it
optionally). The callers keep a Python path that does exactly the same, tested against it
(tests/unit/index/test_vllm_wire_native.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from kvtier.index.ingest import _ingest_c  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - the install builds it
    _ingest_c = None

NATIVE = _ingest_c is not None
# decode_batch(payload, stored_cls) -> (ts, [stored_cls instance | raw event bytes]) | None
decode_batch: Callable[[bytes, type], Any] | None = getattr(_ingest_c, "decode_batch", None)
# new_records(blocks, path, parents, start, block_size, window, body, one) -> last record
new_records: Callable[..., list[Any]] | None = getattr(_ingest_c, "new_records", None)
