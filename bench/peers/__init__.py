"""Peers our benchmarks measure against, run on the same vLLM, model and prompts."""
