"""What a real vLLM engine sees: time to first token by tier (``tier_latency``), the connector's
cost per engine step (``connector_overhead``, ``decode_overhead``)."""
