"""Telling a Redis that lost its data from one that kept it (used by ``RedisIndex``).

A Redis restarted without persistence (or flushed, or replaced by an empty one at the same
address) answers again as if nothing happened, but every namespace, location, cursor and
entry is gone. Writers that only look at cursors cannot tell: a busy one sees "unknown
location" or "namespace not registered" on its next write, an idle one nothing at all, and the
index would answer "nobody holds anything" while reporting ready.

So the backend keeps a *generation* in Redis: ``<prefix>generation``, a random id that the
first index process finding none sets (SET NX) and every process reads back and adopts
(replicas sharing one Redis adopt the same id). ``check`` compares what Redis holds with the
adopted id:

- the same id: Redis has the data this process wrote, even if it restarted in between (its
  ``run_id``, from ``INFO server``, changed: the data came back from its RDB/AOF). Such a
  restart is logged and counted, nothing more: cursors that went back with an older dump are
  gaps, which writers already resync on.
- missing or different: a *reset*. Adopt a new generation (SET NX again: another replica may
  have set one first), call ``recover`` (the backend writes back the namespaces and locations
  it knows), and count it: writers compare ``BackendResets.resets`` with what they last sent
  their whole state for, and send it again.

On Redis Cluster (``lost_on_move``: the backend is one shard of ``RedisClusterIndex``) a new
run_id is a reset too: another node now serves the shard, a replica promoted by a failover
(which may lack the newest writes: replication is asynchronous) or the slot's new owner after
a reshard, and nothing can tell whether every acknowledged write reached it. ``where`` names
the node serving the shard as the client's slot map has it (no round trip): ``moved()``
compares it with the node ``check`` adopted, so the backend can refuse an answer that came from
a node it has not checked yet.

Threading: thread-safe (one lock around a check; ``recover`` runs under it, so two threads
noticing the same reset recover once).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import redis

from kvtier.index.api import BackendResets
from kvtier.index.backends.redis_shard import ShardClient

log = logging.getLogger(__name__)


class GenerationWatch:
    def __init__(
        self,
        client: redis.Redis | ShardClient,
        key: bytes,
        url: str,
        recover: Callable[[], None],
        where: Callable[[], str] | None = None,
    ) -> None:
        """``recover``: write back what this process knows (raises if Redis fails meanwhile:
        the next ``check`` tries again). ``where``: the node serving the data, on a cluster
        (then a new run_id is a reset, see the module docstring)."""
        self._r = client
        self._where = where
        self._adopted_where = ""
        self._key = key
        self._url = url
        self._recover = recover
        self._lock = threading.RLock()
        self.generation: bytes | None = None  # adopted; None until Redis first answered
        self._run_id = ""
        self._resets = 0
        self._restarts = 0
        self._reason = ""
        self._lost = False  # a reset was seen, no new generation adopted yet
        self._recovering = False  # adopted, ``recover`` not done yet

    def state(self) -> BackendResets:
        with self._lock:
            return BackendResets(
                self._resets, self._restarts, self._reason, self._lost or self._recovering
            )

    def establish(self) -> None:
        """Adopt Redis's generation at first contact (a process start: whatever Redis holds
        then is the truth, nothing of ours was lost). Redis errors propagate."""
        with self._lock:
            if self.generation is None:
                self.generation, self._run_id = self._adopt()

    def moved(self) -> bool:
        """Whether the client now routes to a node other than the one ``check`` adopted (a
        cluster shard after a failover or a reshard); always False on a single Redis."""
        return self._where is not None and self._where() != self._adopted_where

    def forget(self) -> None:
        """The prefix was deleted on purpose (``flush``): adopt afresh, no reset."""
        with self._lock:
            self.generation = None
            self._lost = self._recovering = False

    def check(self) -> None:
        """Compare Redis's generation with ours; on a reset adopt a new one and recover.
        Redis errors propagate (the caller reports them); what was not done is retried by
        the next call."""
        with self._lock:
            if self.generation is None:
                self.generation, self._run_id = self._adopt()
                return
            moved_to = self._where() if self._where is not None else ""  # the node asked next
            pipe = self._r.pipeline(transaction=False)
            pipe.get(self._key)
            pipe.info("server")
            generation, info = pipe.execute(raise_on_error=False)
            if isinstance(generation, Exception):
                raise generation
            run_id = _run_id(info)
            if (  # a cluster shard served by another node: it may lack our newest writes
                self._where is not None
                and not self._lost
                and (moved_to != self._adopted_where or (run_id and run_id != self._run_id))
            ):
                self._lost = True
                self._resets += 1
                self._reason = (
                    f"shard moved from {self._adopted_where} (run_id {self._run_id[:8]}) to "
                    f"{moved_to} (run_id {run_id[:8]}): a failover or a reshard may have lost "
                    "acknowledged writes"
                )
                log.warning("%s at %s: resyncing every source", self._reason, self._url)
            elif generation != self.generation and not self._lost:
                self._lost = True
                self._resets += 1
                cause = "generation key missing" if generation is None else "generation changed"
                if run_id and self._run_id and run_id != self._run_id:
                    cause += f"; redis restarted, run_id {self._run_id[:8]} -> {run_id[:8]}"
                self._reason = f"redis backend lost its data ({cause})"
                log.warning("%s at %s: resyncing every source", self._reason, self._url)
            elif not self._lost and run_id and self._run_id and run_id != self._run_id:
                self._restarts += 1
                log.warning("redis %s restarted (run_id %s -> %s) with its data: nothing to "
                            "resync", self._url, self._run_id[:8], run_id[:8])  # fmt: skip
            if run_id:
                self._run_id = run_id
            if self._lost:
                self.generation, self._run_id = self._adopt()
                self._lost, self._recovering = False, True
            if self._recovering:
                self._recover()
                self._recovering = False
                log.warning("redis %s: namespaces and locations registered again", self._url)

    def _adopt(self) -> tuple[bytes, str]:
        """Set a generation unless Redis has one; return the one it has, and its run_id."""
        where = self._where() if self._where is not None else ""  # before the pipeline binds
        pipe = self._r.pipeline(transaction=False)
        pipe.set(self._key, uuid.uuid4().hex.encode(), nx=True)
        pipe.get(self._key)
        pipe.info("server")
        written, generation, info = pipe.execute(raise_on_error=False)
        if isinstance(generation, Exception):
            raise generation
        if generation is None:  # pragma: no cover - SET refused (READONLY) or key deleted
            if isinstance(written, Exception):
                raise written
            raise redis.ConnectionError("the generation key vanished while being set")
        self._adopted_where = where
        return generation, _run_id(info)


def _run_id(info: object) -> str:
    """Redis's run_id, or '' where INFO is refused (some managed Redis rename it): the
    generation alone then decides."""
    if isinstance(info, dict):
        return str(info.get("run_id", ""))
    return ""
