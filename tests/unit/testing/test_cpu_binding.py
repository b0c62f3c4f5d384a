"""The cores vLLM engines are told to compute on (``kvtier.testing.models.cpu_binding``): the
same for every configuration, never left to vLLM's automatic binding, which differs with and
without a KV connector."""

from __future__ import annotations

import os

import pytest

from kvtier.testing.models import cpu_binding, vllm_env


def _cores(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(10, 10 + n)))


def test_one_engine_gets_every_core(monkeypatch: pytest.MonkeyPatch) -> None:
    _cores(monkeypatch, 2)
    assert cpu_binding() == {"VLLM_CPU_OMP_THREADS_BIND": "10,11"}
    # what every engine launched through vllm_env gets, unless told otherwise
    assert vllm_env()["VLLM_CPU_OMP_THREADS_BIND"] == "10,11"
    assert vllm_env(VLLM_CPU_OMP_THREADS_BIND="0|1")["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


def test_engines_of_a_fleet_get_a_core_each_round_robin(monkeypatch: pytest.MonkeyPatch) -> None:
    _cores(monkeypatch, 2)
    binds = [cpu_binding(slot, 4)["VLLM_CPU_OMP_THREADS_BIND"] for slot in range(4)]
    assert binds == ["10", "11", "10", "11"]
    _cores(monkeypatch, 8)
    binds = [cpu_binding(slot, 4)["VLLM_CPU_OMP_THREADS_BIND"] for slot in range(4)]
    assert binds == ["10", "11", "12", "13"]


def test_ranks_get_a_core_each(monkeypatch: pytest.MonkeyPatch) -> None:
    _cores(monkeypatch, 4)
    assert cpu_binding(ranks=2) == {"VLLM_CPU_OMP_THREADS_BIND": "10|11"}
    assert cpu_binding(1, 2, ranks=2) == {"VLLM_CPU_OMP_THREADS_BIND": "12|13"}
