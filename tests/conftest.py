"""Fixtures shared by every tier: a run dir, a small store config and namespace; and real
processes on free ports (``store_proc``, the session's ``redis_server``) for the tiers that
may start them (tests/unit refuses: tests/unit/conftest.py). Helpers: tests/support.

vLLM driver runs fork from one process that imported vLLM once (``vllm_forkserver``, started
at the first run): ~9 s of a ~12.5 s run is that import, and the suite makes a hundred runs.
vLLM servers (``VllmServer``) run their model worker inside the engine-core process
(``WORKER_IN_ENGINE_ENV``): one fresh interpreter less per server, ~17 s each."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.config import StoreConfig
from kvtier.core.keys import Namespace
from kvtier.testing.redis_cluster import LocalRedisCluster, start_redis_cluster

from support.helpers import RedisServer, StoreProcess, start_redis, start_store_process


@pytest.fixture(scope="session", autouse=True)
def vllm_forkserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    from kvtier.testing import vllm_forkserver
    from kvtier.testing.vllm_server import WORKER_IN_ENGINE_ENV

    path = tmp_path_factory.getbasetemp() / "vllm-forkserver.sock"
    os.environ[vllm_forkserver.ENV] = str(path)
    os.environ[WORKER_IN_ENGINE_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(vllm_forkserver.ENV, None)
        os.environ.pop(WORKER_IN_ENGINE_ENV, None)
        vllm_forkserver.stop(path)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path


@pytest.fixture
def store_config(run_dir: Path) -> StoreConfig:
    return StoreConfig(
        node_id="test-node",
        grpc_port=0,
        http_port=0,
        run_dir=run_dir,
        pool={"capacity": 16 << 20, "page_size": 64 << 10, "prefault": True},
    )


@pytest.fixture
def namespace() -> Namespace:
    return Namespace(
        model="test-model",
        dtype="float16",
        num_layers=2,
        num_kv_heads=2,
        head_size=64,
        chunk_tokens=32,
    )


@pytest.fixture
def store_proc(run_dir: Path) -> Iterator[StoreProcess]:
    proc = start_store_process(run_dir, capacity="16MiB")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session; tests isolate themselves with key prefixes."""
    server = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """One real Redis Cluster for the session (3 masters, a replica each); tests isolate
    themselves with key prefixes. Drills that kill or move nodes start their own."""
    cluster = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


def pytest_report_header(config: pytest.Config) -> str:
    return f"kvtier tests: python {sys.version.split()[0]}, cpus {os.cpu_count()}"
