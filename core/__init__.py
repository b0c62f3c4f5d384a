"""kvtier: a tiered KV-cache store for LLM serving (GPU, node-shared DRAM, remote DRAM)."""

__version__ = "0.1.0"
