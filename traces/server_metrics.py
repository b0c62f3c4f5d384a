"""A vLLM server's Prometheus counters, read around a replay: ``fetch_metrics`` takes a
server's ``/metrics``, ``parse_prometheus`` sums its samples by name, ``metrics_delta`` gives
what the prefix-cache counters (``CACHE_METRICS``) moved by between two readings (``kvtier
trace replay --metrics``; the benchmarks read theirs with ``parse_prometheus`` too).
"""

from __future__ import annotations


async def fetch_metrics(
    url: str, timeout_s: float = 5.0, keep_labels: tuple[str, ...] = ()
) -> dict[str, float] | None:
    """Prometheus counters of a vLLM server (see ``parse_prometheus``), or None if unreachable."""
    import aiohttp

    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(timeout_s)
            ) as r,
        ):
            if r.status != 200:
                return None
            text = await r.text()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None
    return parse_prometheus(text, keep_labels)


def parse_prometheus(text: str, keep_labels: tuple[str, ...] = ()) -> dict[str, float]:
    """Samples by name, summed over every label except ``keep_labels`` (prometheus_client's
    parser reads the text).

    A kept label becomes part of the key, vLLM-driver style:
    ``vllm:prompt_tokens_cached_by_source_total{source=host}``; samples without it keep the
    bare name.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            parts = [f"{k}={sample.labels[k]}" for k in keep_labels if k in sample.labels]
            if parts:
                name = f"{name}{{{','.join(parts)}}}"
            out[name] = out.get(name, 0.0) + float(sample.value)
    return out


CACHE_METRICS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
)


def metrics_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    if before is None or after is None:
        return {}
    return {name: after[name] - before.get(name, 0.0) for name in CACHE_METRICS if name in after}
