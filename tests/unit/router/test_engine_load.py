"""The router's reading of an instance's load from its ``/metrics`` page (``engine_load``)
agrees with ``prometheus_client``'s full parse on every page shape vLLM can send: several
engines, labels with spaces, braces and escaped quotes, timestamps, per-reason breakdowns,
names that extend the gauge's, comments that mention it. tests/engine/test_router_vllm.py
compares the two on a live vLLM page."""

from __future__ import annotations

import pytest

from kvtier.router.engine_load import EngineLoad, engine_load

from support.metrics_pages import full_parse

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="my model {v2}"} 3.0
vllm:num_requests_running{engine="1",model_name="say \\"hi\\""} 2.0 1712345678000
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="my model {v2}"} 4.0
vllm:num_requests_waiting{engine="1",model_name="say \\"hi\\""} 1.0
vllm:num_requests_waiting{engine="0",reason="capacity"} 7.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 9.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="my model {v2}"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="say \\"hi\\""} 0.75
vllm:kv_cache_usage_perc_max{engine="0"} 0.9
"""


def test_engine_load_agrees_with_a_full_parse() -> None:
    assert engine_load(PAGE) == full_parse(PAGE) == EngineLoad(5, 5, 0.5)


def test_a_gauge_without_labels_and_a_page_without_the_gauges() -> None:
    page = "vllm:num_requests_running 2\nvllm:num_requests_waiting\t1\n"
    assert engine_load(page) == full_parse(page) == EngineLoad(2, 1, 0.0)
    other = "# a page of another server\nprocess_cpu_seconds_total 12.5\n"
    assert engine_load(other) == EngineLoad() == full_parse(other)
    assert engine_load("") == EngineLoad()


@pytest.mark.parametrize(
    "line",
    [
        'vllm:num_requests_running{engine="0"} many',  # not a number
        'vllm:num_requests_running{engine="0"} NaN',  # a number, but no load
        'vllm:num_requests_running{engine="0"} +Inf',
        'vllm:num_requests_running{engine="0"',  # cut off
        'vllm:num_requests_running{engine="0} 1',  # unterminated value
        "vllm:num_requests_running{engine} 1",  # a label without a value
        "vllm:num_requests_running{}",  # no value
    ],
)
def test_a_sample_it_cannot_read_is_an_error_not_a_load(line: str) -> None:
    # the router then keeps the instance's last load (router/service.py: _scrape_one)
    with pytest.raises(ValueError):
        engine_load(f"vllm:num_requests_waiting 1\n{line}\n")
