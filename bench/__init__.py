"""kvtier's benchmarks: each hot path measured beside its floor (memcpy, raw transport) or a peer
in the same run. Run them with ``kvtier bench ...``; they are not tests and assert no timings.

``micro/`` one hot path each, ``engine/`` through a real vLLM, ``cluster/`` and ``knee/`` the
experiments, ``faults/`` the fault drills, ``peers/`` LMCache and Mooncake run the same way.
"""
