"""Fixtures shared by every tier: a run dir, a small store config and namespace; and real
processes on free ports (``store_proc``, the session's ``redis_server``) for the tiers that
may start them (tests/unit refuses: tests/unit/conftest.py). Helpers: tests/support.

vLLM driver runs fork from one process that imported vLLM once (``vllm_forkserver``, started
at the first run): ~9 s of a ~12.5 s run is that import, and the suite makes a hundred runs.
vLLM servers (``VllmServer``) run their model worker inside the engine-core process
(``WORKER_IN_ENGINE_ENV``): one fresh interpreter less per server, ~17 s each.

``make test`` runs the tiers that start no vLLM engine on two pytest-xdist workers (``-n 2``,
each module on one worker: its module fixtures set up once), then tests/engine and
tests/drills alone, in order. Beside the other lane the engines run on a loaded host: that
once made a sliding-window model lose its saves (pool space came back after the window had
freed the blocks; the connector holds pool space ahead for such models since,
kvtier.connector.save_slab), and on 2026-11-30 a fresh-clone run with every tier in one
``-n 2`` had the TP-2 drill's commits all fail (``save_errors`` 6, no hit to corrupt; not
reproduced alone under four busy loops, cause not found). Under ``-n`` the lanes come from
``pytest_xdist_make_scheduler`` below (the engine tiers in one, in case they are run so)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
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
def short_tmp() -> Iterator[Path]:
    """A fresh folder with a short path (``/tmp/kt-…``), removed after the test: for what holds
    Unix sockets (a store's run dir: its control socket), whose address must fit 108 bytes;
    ``tmp_path`` can be deeper than that (under pytest-xdist, or a long user name)."""
    path = Path(tempfile.mkdtemp(prefix="kt-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def run_dir(short_tmp: Path) -> Path:
    """A store's run dir, short enough for its control socket's address (``short_tmp``)."""
    path = short_tmp / "run"
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


ENGINE_TIERS = ("engine", "drills")  # tests/<tier>/: every test there runs vLLM engines


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (``-n``): the lanes of the module docstring. xdist's own
    ``xdist_group`` marker does not group on pytest 9 (it renames ``Item._nodeid``, which pytest
    9 no longer reads), so the scopes are drawn here from the test ids."""
    from xdist.scheduler import LoadScopeScheduling

    class EngineLane(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_lane(nodeid)

    return EngineLane(config, log)


def xdist_lane(nodeid: str) -> str:
    """What a test runs in order with under ``-n``: every test of the engine tiers
    (tests/engine, tests/drills: all that run vLLM engines), else its module's tests."""
    module = nodeid.split("::", 1)[0]
    parts = module.split("/")
    return "vllm-engines" if len(parts) > 2 and parts[1] in ENGINE_TIERS else module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that runs a vLLM engine (``vllm`` marker) must sit in an engine tier, or under
    ``-n`` it would run beside another engine."""
    tests_dir = Path(__file__).parent
    for item in items:
        tier = Path(str(item.path)).relative_to(tests_dir).parts[0]
        if item.get_closest_marker("vllm") and tier not in ENGINE_TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a vllm test belongs in tests/engine or drills")


def pytest_report_header(config: pytest.Config) -> str:
    return f"kvtier tests: python {sys.version.split()[0]}, cpus {os.cpu_count()}"
