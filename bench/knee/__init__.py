"""``kvtier bench knee``: how much GPU KV (and DRAM) a multi-turn workload needs."""
