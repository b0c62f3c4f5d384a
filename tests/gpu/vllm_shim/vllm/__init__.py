"""A stand-in for the few vLLM types kvtier's worker copy path imports, for GPU machines that
cannot carry vLLM's CUDA build (tests/gpu). Nothing else of vLLM exists here: an import of any
other vLLM module fails, which is how tests/integration/test_vllm_shim.py proves the copy path
needs no more. The same file holds each class here to vLLM's real one."""
