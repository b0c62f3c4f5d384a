"""A vLLM KV connector that does nothing: the floor of what any connector costs.

vLLM changes its own behaviour when ``--kv-transfer-config`` names a connector, whatever the
connector does: on the CPU build its automatic core binding gives the worker one more
OpenMP thread (see ``kvtier.testing.models.cpu_binding``), the scheduler calls the connector's
hooks every step, the model runner builds and hands over connector metadata. Comparing kvtier
with this one (``kvtier bench decode-overhead --configs vllm,vllm-noop,...``) separates what
kvtier's own work costs from what merely having a connector costs.

Load it with ``{"kv_connector": "NoopConnector", "kv_connector_module_path":
"kvtier.testing.noop_connector", "kv_role": "kv_both"}``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

TRANSFER_CONFIG = {
    "kv_connector": "NoopConnector",
    "kv_connector_module_path": "kvtier.testing.noop_connector",
    "kv_role": "kv_both",
}


class NoopConnector(KVConnectorBase_V1):
    """Never finds a token, never saves one."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
