"""The index backends' one suite (tests/support/index_suite.py), on the backends that live in
this process: the in-memory index, and the gRPC client of a served in-memory index (the
Redis index: tests/integration/test_index_redis_backend.py)."""

from __future__ import annotations

import pytest

from support.index_suite import *  # noqa: F403  (the suite's fixtures and tests run here)


@pytest.fixture(params=["memory", "grpc"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param
