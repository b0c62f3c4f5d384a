"""A stand-in for the few vLLM types kvtier's worker copy path imports, for GPU machines that
cannot carry vLLM's CUDA build (tests/gpu). Nothing else of vLLM exists here: an import of any
other vLLM module fails, which is how tests/test_kv_layouts.py proves the copy path needs no
more. The same test holds each class here to vLLM's real one."""
