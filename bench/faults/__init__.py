"""``kvtier bench faults``: every failure path driven through real vLLM instances."""
