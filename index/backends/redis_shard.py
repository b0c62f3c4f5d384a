"""One shard of the index on Redis Cluster: the node that serves one hash slot, as a client.

``RedisClusterIndex`` splits the index into shards, each a complete ``RedisIndex`` under a
prefix that carries a hash tag (``kvtier:index:{s3}:``), so every key of a shard, and so every
key one of its Lua scripts touches, lives in one hash slot on one master.

redis-py's ``RedisCluster`` refuses scripts in pipelines and retries a failed command on
another node by itself; the index needs both the pipelines and to know which node answered (a
failover's promoted replica may lack the newest writes: see ``redis_watch``). So a shard talks
to its node directly: ``ShardClient`` resolves the node serving its slot from the cluster
client's slot map at every call, and turns what a moving slot answers (MOVED, ASK, TRYAGAIN,
CLUSTERDOWN, a dead node) into a refreshed slot map and a ``redis.ConnectionError``: the
backend reports it as UNAVAILABLE and the next call goes to the node now serving the slot.

Threading: thread-safe as redis-py's clients are; the slot map refresh is redis-py's.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

log = logging.getLogger(__name__)

# what a slot answers while it moves or its node is down: refresh the map, retry later
MOVING = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.AskError,  # MovedError is one
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.MasterDownError,
    redis.exceptions.SlotNotCoveredError,
)
# what a script answers when a key it touches has already been migrated away mid-reshard
NON_LOCAL = "Script attempted to access a non local key"


def moving(exc: BaseException) -> bool:
    """Whether ``exc`` says the slot is moving or its node is gone (retry on a fresh map)."""
    return isinstance(exc, MOVING) or (
        isinstance(exc, redis.ResponseError) and NON_LOCAL in str(exc)
    )


def shard_tags(count: int) -> list[str]:
    """``count`` hash tags whose slots spread evenly over the slot space (tag ``i`` lands in
    the ``i``-th of ``count`` equal ranges), so a cluster whose masters own equal slot ranges
    gets an equal share of shards per master. Deterministic: every process finds the same."""
    tags = []
    span = REDIS_CLUSTER_HASH_SLOTS / count
    for i in range(count):
        lo, hi = int(i * span), int((i + 1) * span)
        n = 0
        while not lo <= key_slot(f"s{i}.{n}".encode()) < hi:
            n += 1
        tags.append(f"s{i}.{n}")
    return tags


class ShardClient:
    """A ``redis.Redis`` look-alike for the node serving ``slot`` (see the module docstring):
    attribute access goes to that node's client; calls and pipelines translate a moving slot
    into ``redis.ConnectionError`` after refreshing the slot map."""

    def __init__(self, cluster: RedisCluster, slot: int) -> None:
        self._cluster = cluster
        self._slot = slot

    def node_name(self) -> str:
        """host:port of the master serving the slot, from the slot map (no round trip)."""
        try:
            return str(self._cluster.nodes_manager.get_node_from_slot(self._slot).name)
        except redis.exceptions.SlotNotCoveredError:
            return ""

    def _node(self) -> redis.Redis:
        try:
            node = self._cluster.nodes_manager.get_node_from_slot(self._slot)
        except redis.exceptions.SlotNotCoveredError as exc:
            self._refresh()
            raise redis.ConnectionError(f"slot {self._slot} not served: {exc}") from None
        client = self._cluster.get_redis_connection(node)
        assert client is not None
        return client

    def _refresh(self) -> None:
        try:
            self._cluster.nodes_manager.initialize()
        except Exception as exc:
            log.debug("cluster slot map refresh failed: %s", exc)

    def _guard(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                result = fn(*args, **kwargs)
            except redis.RedisError as exc:
                if not moving(exc):
                    raise
                self._refresh()
                raise redis.ConnectionError(f"slot {self._slot}: {exc!r}") from None
            if isinstance(result, list):  # a pipeline run with raise_on_error=False
                for item in result:
                    if isinstance(item, redis.RedisError) and moving(item):
                        self._refresh()
                        raise redis.ConnectionError(f"slot {self._slot}: {item!r}")
            return result

        return call

    def pipeline(self, transaction: bool = False) -> redis.client.Pipeline:
        """The node's own pipeline (scripts included), whose ``execute`` is guarded."""
        pipe = self._node().pipeline(transaction=transaction)
        pipe.execute = self._guard(pipe.execute)  # type: ignore[method-assign]
        return pipe

    def register_script(self, script: str) -> Script:
        """A script called through this shard (a node's ``register_script`` would stay bound
        to that node after the slot moved)."""
        return Script(self, script)  # type: ignore[arg-type]  # duck-typed: see above

    def close(self) -> None:  # the cluster client owns the connections
        pass

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._node(), name)
        return self._guard(attr) if callable(attr) else attr
