"""vLLM 0.32's ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``: the two metadata base
classes kvtier's ``connector/metadata.py`` subclasses, as vLLM defines them."""

from abc import ABC, abstractmethod


class KVConnectorMetadata(ABC):  # noqa: B024 (vLLM's own: an ABC without abstract methods)
    """Abstract Metadata used to communicate
    Scheduler KVConnector -> Worker KVConnector.
    """

    pass


class KVConnectorWorkerMetadata(ABC):
    """Abstract Metadata used to communicate back
    Worker KVConnector -> Scheduler KVConnector.
    """

    @abstractmethod
    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        """Aggregate metadata with another `KVConnectorWorkerMetadata` object."""
        pass
