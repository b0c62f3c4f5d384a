"""kvtier and vLLM as real processes on one machine, for the tests, the benchmarks and the demo:
free loopback ports (``ports``), node stores and the index (``services``), tiny random models
(``models``), a vLLM OpenAI server (``vllm_server``), a scripted in-process engine
(``vllm_driver``) with injected faults (``fault_injection``), a whole cluster (``fleet``).

Nothing in the product's serving path imports this package.
"""
