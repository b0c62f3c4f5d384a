"""Pool space taken ahead under placeholder keys and committed under the chunks' own names
(``StoreCore.commit``'s ``as_keys``: an engine's save slab, kvtier.connector.save_slab)."""

from __future__ import annotations

import os

import pytest

from kvtier.core.chunks import LookupStatus
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import KEY_BYTES
from kvtier.store.api.events import EventKind
from kvtier.store.state.core import StoreCore

from support.store_core import CHUNK, NS, keys, put


def placeholders(n: int) -> list[bytes]:
    return [os.urandom(KEY_BYTES) for _ in range(n)]


def test_placeholders_commit_under_the_chunks_names(core: StoreCore, ns_id: bytes) -> None:
    held = placeholders(3)
    alloc = core.allocate(ns_id, held, [CHUNK] * 3)
    where = {loc.key: loc.extents for loc in alloc.locations if loc is not None}
    names = keys(2)
    assert core.commit(alloc.lease_id, held[:2], [0, 0], as_ns_id=ns_id, as_keys=names) == 2
    hits = core.lookup(ns_id, names).hits
    assert [h.key for h in hits] == names
    assert [h.extents for h in hits] == [where[held[0]], where[held[1]]]  # the same pages
    assert core.lookup(ns_id, held[:1]).stop is LookupStatus.MISS  # the placeholder is gone
    batches = core.events.read(1)
    assert isinstance(batches, list)
    stored = [(e.kind, e.namespace, e.keys) for b in batches for e in b.events]
    assert stored == [(EventKind.STORED, ns_id, tuple(names))]
    # the third placeholder is still held under the lease, and can be given back
    assert core.abort(alloc.lease_id, held[2:]) == 1
    assert core.stats()["writing_bytes"] == 0
    core.check_invariants()


def test_a_name_already_stored_frees_the_placeholder(core: StoreCore, ns_id: bytes) -> None:
    names = keys(2)
    put(core, ns_id, names[:1])
    used = core.stats()["used_bytes"]
    held = placeholders(2)
    alloc = core.allocate(ns_id, held, [CHUNK] * 2)
    assert core.commit(alloc.lease_id, held, [0, 0], as_ns_id=ns_id, as_keys=names) == 1
    assert core.stats()["used_bytes"] == used + CHUNK  # one chunk more, not two
    assert [h.checksum for h in core.lookup(ns_id, names[:1]).hits] == [1]  # kept what it had
    assert core.lookup(ns_id, names).stop is LookupStatus.HIT
    core.check_invariants()


def test_names_in_another_namespace_of_the_same_tenant(core: StoreCore, ns_id: bytes) -> None:
    lora = core.register_namespace(NS.model_copy(update={"revision": "fine-tuned"}), CHUNK)
    held = placeholders(1)
    alloc = core.allocate(ns_id, held, [CHUNK])
    assert core.commit(alloc.lease_id, held, [0], as_ns_id=lora, as_keys=keys(1)) == 1
    assert core.lookup(lora, keys(1)).stop is LookupStatus.HIT
    assert core.lookup(ns_id, keys(1)).stop is LookupStatus.MISS
    core.check_invariants()


def test_another_tenants_namespace_is_refused(core: StoreCore, ns_id: bytes) -> None:
    other = core.register_namespace(NS.model_copy(update={"cache_salt": "b"}), CHUNK)
    held = placeholders(2)
    alloc = core.allocate(ns_id, held, [CHUNK] * 2)
    with pytest.raises(KvtierError) as err:
        core.commit(alloc.lease_id, held, [0, 0], as_ns_id=other, as_keys=keys(2))
    assert err.value.code is ErrorCode.PERMISSION_DENIED
    assert core.lookup(other, keys(2)).stop is LookupStatus.MISS
    assert core.abort(alloc.lease_id) == 2  # nothing was taken out of the lease
    core.check_invariants()


@pytest.mark.parametrize(
    ("as_keys", "code"),
    [
        (keys(1), ErrorCode.INVALID_ARGUMENT),  # one name for two placeholders
        ([keys(1)[0]] * 2, ErrorCode.INVALID_ARGUMENT),  # one name twice
        ([b"short", b"names"], ErrorCode.INVALID_ARGUMENT),
    ],
)
def test_bad_names_get_a_clear_error(
    core: StoreCore, ns_id: bytes, as_keys: list[bytes], code: ErrorCode
) -> None:
    held = placeholders(2)
    alloc = core.allocate(ns_id, held, [CHUNK] * 2)
    with pytest.raises(KvtierError) as err:
        core.commit(alloc.lease_id, held, [0, 0], as_ns_id=ns_id, as_keys=as_keys)
    assert err.value.code is code
    assert core.commit(alloc.lease_id, held, [0, 0], as_ns_id=ns_id, as_keys=keys(2)) == 2


def test_another_chunk_size_is_refused(core: StoreCore, ns_id: bytes) -> None:
    bigger = core.register_namespace(NS.model_copy(update={"chunk_tokens": 8}), 2 * CHUNK)
    held = placeholders(1)
    alloc = core.allocate(ns_id, held, [CHUNK])
    with pytest.raises(KvtierError) as err:
        core.commit(alloc.lease_id, held, [0], as_ns_id=bigger, as_keys=keys(1))
    assert err.value.code is ErrorCode.WRONG_SIZE
