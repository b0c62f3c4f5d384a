"""The index backends' one suite (tests/support/index_suite.py) on the Redis index, against
the session's real redis-server (the in-memory and gRPC backends:
tests/unit/index/test_backends.py)."""

from __future__ import annotations

import pytest

from support.index_suite import *  # noqa: F403  (the suite's fixtures and tests run here)


@pytest.fixture(params=["redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param
