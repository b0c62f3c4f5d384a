"""Fixtures of the store's state-machine tests: a small in-process ``StoreCore`` (a fake
clock, 30 pages) and one namespace registered in it."""

from __future__ import annotations

import pytest

from kvtier.store.state.core import StoreCore

from support.store_core import CHUNK, NS, make_core


@pytest.fixture
def core() -> StoreCore:
    return make_core()


@pytest.fixture
def ns_id(core: StoreCore) -> bytes:
    return core.register_namespace(NS, CHUNK)
