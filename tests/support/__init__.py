"""What the tests share, as a package (``from support.helpers import ...``): pytest puts
``tests/`` on the path (``pythonpath`` in pyproject.toml), and children started with
multiprocessing's spawn inherit that path, so they import ``support.*`` alike.

- ``helpers``: stores, indexes and ``redis-server`` as real processes; functions children run
- ``engine_rig``: vLLM's real ``Scheduler`` driving the connector, with a checking model
- ``kv_rig``: a paged KV cache in vLLM's layouts and the connector's worker over it
- ``vllm_fixtures``: a tiny model, an in-process engine, a KV-event publisher with faults
- ``trace_helpers``, ``trace_vllm_server``: traces written in tests; the replay tests' vLLM
- ``stub_backend``: an HTTP server answering like a vLLM instance (the router's tests)
- ``ext_proc``: Envoy's side of the endpoint picker's ext_proc stream
- ``secure_env``, ``secure_store``, ``certs``, ``index_rig``, ``router_rig``,
  ``grpc_recorder``: credentials, certificates and services with them (tests/integration/security)
- ``layout``: the product's files and their import names (the layering and packaging tests)
- ``remote_netns_driver``: run inside a network namespace by tests/integration/test_remote_netns.py
"""
