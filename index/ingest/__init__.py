"""Feeding the index: one follower per source (``follower``): vLLM engines' KV events
(``vllm_events``, decoded by ``vllm_wire``, mapped to chunks by ``vllm_blocks``) and node stores'
event streams (``store_events``); ``manager`` runs them and reports their health.

May import: ``kvtier.index.api``, ``kvtier.index.backends``, ``kvtier.store.api`` / ``client``,
``kvtier.core``.
"""
