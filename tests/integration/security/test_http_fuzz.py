"""Fuzz the services' HTTP APIs from their own OpenAPI documents (schemathesis), with the
admin's credential (the most reach): no input may produce a server error, and a request
without a credential is refused on every endpoint that reveals state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from kvtier.testing.services import Service, _start, start_store

from support.secure_env import TOKENS, auth_env

OPEN = {"/healthz", "/readyz", "/metrics"}


@pytest.fixture(scope="module")
def index_http() -> Iterator[Service]:
    index = _start(["index", "serve", "--grpc-port", "0", "--http-port", "0"], auth_env())
    try:
        yield index
    finally:
        index.stop()


@pytest.fixture(scope="module")
def store_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    run_dir: Path = tmp_path_factory.mktemp("http-fuzz")
    store = start_store(run_dir, "16MiB", "fuzz-node", remote=False, env=auth_env())
    try:
        yield store
    finally:
        store.stop()


ADMIN = {"Authorization": f"Bearer {TOKENS['admin']}"}


def fuzz(service: Service, examples: int = 40) -> int:
    """Every operation of the service's OpenAPI, ``examples`` generated cases each (run
    without schemathesis's pytest plugin, which this pytest version does not load)."""
    schema = schemathesis.openapi.from_url(f"{service.http}/openapi.json")
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
        @given(operation.as_strategy())
        def one(case: schemathesis.Case) -> None:
            response = case.call(headers=ADMIN, timeout=10)
            assert response.status_code < 500, (case.path, case.body, response.text)
            if case.path not in OPEN:
                anonymous = case.call(timeout=10)
                assert anonymous.status_code in (401, 413, 422), (case.path, anonymous)

        one()
    return operations


def test_index_http_api(index_http: Service) -> None:
    assert fuzz(index_http) >= 7
    assert index_http.proc.poll() is None


def test_store_http_api(store_http: Service) -> None:
    assert fuzz(store_http) >= 4
    assert store_http.proc.poll() is None
