"""The fault drills (``kvtier bench faults``), short: real vLLM CPU instances and real store
processes through every failure path that once let a wrong token through or took the engine
down. Each drill must end with 0 wrong tokens, 0 engine crashes and 0 leaked leases, and with
the fault visibly handled (the counters that say so)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.bench.faults.drills import DRILLS, salted
from kvtier.bench.faults.run import DrillContext, DrillResult, Prompts

pytestmark = pytest.mark.vllm

REQUESTS = 2  # per drill (the bench runs >= 100)
SEEDS = range(1, 14)  # every drill's prompt seed: one reference run serves them all


@pytest.fixture(scope="module")
def drills(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DrillContext]:
    context = DrillContext(tmp_path_factory.mktemp("drills"), REQUESTS)
    prompts = [Prompts.make(REQUESTS, seed) for seed in SEEDS]
    batch = [p for ps in prompts for p in ps.a + ps.b]
    context.prefetch(
        batch + salted(prompts[8].a, "tenant\nb\u00e9") + salted(prompts[8].a, "tenant-c")
    )
    yield context


def run(drills: DrillContext, name: str) -> DrillResult:
    _, drill = DRILLS[name]
    result = drill(drills)
    assert result.engine_crashes == 0, result
    assert result.wrong_tokens == 0, result
    assert result.leaked_leases == 0, result
    return result


def test_store_restarted_between_lookup_and_load(drills: DrillContext) -> None:
    """Extents of the old pool incarnation are never copied out of the new one."""
    result = run(drills, "restart-before-load")
    assert result.counters["stale_epoch_loads"] == REQUESTS
    assert result.recomputes == REQUESTS


def test_store_restarted_with_load_queued(drills: DrillContext) -> None:
    result = run(drills, "restart-queued-load")
    assert result.recomputes == REQUESTS


@pytest.mark.parametrize("name", ["lapsed-lease", "checksum-mismatch", "copy-exception"])
def test_failed_load_commits_no_save_of_its_step(drills: DrillContext, name: str) -> None:
    """The failing step completed 3 new chunks over blocks never loaded: none is committed,
    they are saved again once recomputed, and a fresh instance reads them back exactly."""
    result = run(drills, name)
    assert result.recomputes == REQUESTS
    assert result.counters["saves_discarded_after_failed_load"] >= 3 * REQUESTS, result.counters
    assert result.hits.get("host", 0) > 0  # the fresh instance read what was stored
    if name == "checksum-mismatch":  # exactly the corrupt chunk is deleted, not the run
        assert result.counters["corrupt_chunks_deleted"] == REQUESTS


@pytest.mark.parametrize("name", ["weights-changed-in-place"])  # rope-override: the bench
def test_other_weights_under_one_name_share_nothing(drills: DrillContext, name: str) -> None:
    result = run(drills, name)
    assert result.hits.get("host", 0) == 0


def test_any_cache_salt_works_and_isolates(drills: DrillContext) -> None:
    result = run(drills, "salt-with-newline")
    assert result.hits.get("host", 0) > 0  # the salted prompts hit their own chunks


@pytest.mark.parametrize("name", ["store-down-new-salt", "pool-too-small"])
def test_store_refusals_are_misses_not_crashes(drills: DrillContext, name: str) -> None:
    result = run(drills, name)
    assert result.counters.get("lookup_errors", 0) >= 1


def test_hung_store_never_stalls_the_engine(drills: DrillContext) -> None:
    """Liveness, not speed: the longest scheduler hook call with the store frozen stays two
    orders of magnitude under the 10 s a blocking call would have taken."""
    result = run(drills, "store-hung")
    assert result.counters["longest_hook_call_s"] < 1.0
    assert result.counters.get("lookup_deadline_misses", 0) >= 1


def test_pool_full_of_pinned_chunks(drills: DrillContext) -> None:
    result = run(drills, "pool-full-pinned")
    assert result.counters.get("save_no_space", 0) > 0


def test_concurrent_requests_with_failed_loads_and_preemption(drills: DrillContext) -> None:
    """Every request in flight at once with failed loads, in a KV cache small enough that
    vLLM preempts; leases are read while the engine is alive."""
    result = run(drills, "concurrent-failed-loads")
    assert result.counters["preemptions"] >= 1
    assert result.counters.get("load_failed_requests", 0) >= 1


def test_bad_disk_files_are_misses_under_concurrent_loads(drills: DrillContext) -> None:
    """Every chunk file damaged but each prompt's first: stages stop at the second (counted
    short), the first loads, nothing damaged is ever loaded, and what the recomputing step
    saved reads back exactly."""
    result = run(drills, "disk-bad-files")
    assert result.counters["damaged_files"] > 0
    assert result.counters["disk_stage_short"] > 0
    assert result.counters["disk_hit_tokens"] > 0  # batched requests: the connector's count


def test_disk_write_and_read_errors_are_misses_and_the_store_serves_on(
    drills: DrillContext,
) -> None:
    result = run(drills, "disk-io-errors")  # 0 wrong tokens, the store alive throughout
    assert result.counters["store_disk_write_errors"] >= 3, result.counters  # one per kind
    assert result.counters["store_disk_read_errors"] >= 1, result.counters
    assert result.counters["temporary_files_left"] == 0
    # the stages that met the failing reads came back short: those requests recomputed
    counts = result.counters
    stages = counts.get("disk_stage_errors", 0) + counts.get("disk_stage_short", 0)
    assert stages > 0, counts


def test_a_killed_stores_disk_serves_the_next_store(drills: DrillContext) -> None:
    result = run(drills, "disk-store-killed")
    # B shares A's first 256 tokens (4 chunks): all from the new store's disk
    assert result.counters["disk_hit_tokens"] == 256 * REQUESTS
