"""The media behind one interface: GPU (vLLM's paged KV), CPU (node DRAM pool), remote."""
