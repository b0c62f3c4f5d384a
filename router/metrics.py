"""What the router exports to Prometheus (``/metrics``): latency as the proxy sees it, every
decision and why, how well it predicted the cache, and what went wrong."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
DECISION_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "kvtier_router_ttft_seconds", "request to first byte of the answer", registry=r,
            buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.tpot = Histogram(
            "kvtier_router_tpot_seconds", "between streamed chunks after the first", registry=r,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        )  # fmt: skip
        self.e2e = Histogram(
            "kvtier_router_e2e_seconds", "request to last byte", registry=r,
            buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.decision = Histogram(
            "kvtier_router_decision_seconds",
            "routing decision: tokenize + index query + score",
            registry=r,
            buckets=DECISION_BUCKETS,
        )
        self.decisions = Counter(
            "kvtier_router_decisions", "decisions by policy and reason", ["policy", "reason"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "kvtier_router_prompt_tokens", "prompt tokens routed", registry=r
        )
        self.predicted_cached = Counter(
            "kvtier_router_predicted_cached_tokens",
            "prompt tokens the chosen instance held on GPU or its node (router's estimate)",
            registry=r,
        )
        self.realized_cached = Counter(
            "kvtier_router_realized_cached_tokens",
            "cached prompt tokens vLLM reported (usage.prompt_tokens_details.cached_tokens)",
            registry=r,
        )
        self.retries = Counter(
            "kvtier_router_retries", "requests sent again elsewhere", ["reason"], registry=r
        )
        self.ejections = Counter(
            "kvtier_router_ejections", "instances taken out of rotation", ["reason"], registry=r
        )
        self.rejected = Counter(
            "kvtier_router_rejected", "requests answered by the router itself", ["status"],
            registry=r,
        )  # fmt: skip
        self.stream_errors = Counter(
            "kvtier_router_stream_errors", "streams that failed after bytes were sent", registry=r
        )
        self.backends = Gauge(
            "kvtier_router_backends", "instances known, by state", ["state"], registry=r
        )
        self.index_degraded = Counter(
            "kvtier_router_index_degraded",
            "decisions made without the index (routed by load): it missed "
            "router.index_timeout_s (timeout), earlier calls still hold every slot (busy), "
            "or it failed (error)",
            ["reason"],
            registry=r,
        )
        self.replica_lag = Gauge(
            "kvtier_router_index_replica_lag_seconds",
            "since the router's replica of the index was last known current (-1: no replica "
            "or never current); past router.index_replica_max_stale_s decisions ask the index",
            registry=r,
        )
        self.replica_lag.set(-1)
        self.peers = Gauge(
            "kvtier_router_peers", "other router replicas whose shares are fresh", registry=r
        )
        self.offloads = Counter(
            "kvtier_router_prefill_offloads",
            "prefills run on a helper instance, by outcome: ok (its chunks reached the "
            "index), unsettled (answered, chunks not seen in time), failed, busy (no slot)",
            ["outcome"],
            registry=r,
        )
        self.discovery_refused = Counter(
            "kvtier_router_discovery_refused",
            "instances announced to the index at a URL router.discover_allow does not admit "
            "(once per location and URL)",
            registry=r,
        )
