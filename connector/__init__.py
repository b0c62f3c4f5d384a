"""The vLLM KV connector: tier-first prefix hits from node DRAM and remote tiers.

vLLM loads it with ``"kv_connector": "KvtierConnector", "kv_connector_module_path":
"kvtier.connector"``. The class is imported lazily so that ``kvtier.connector.config`` (read by
the services' config model) does not pull in vLLM and torch.
"""

from typing import Any

__all__ = ["KvtierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvtierConnector":
        from kvtier.connector.vllm_connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(name)
