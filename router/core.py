"""The routing decision, shared by the OpenAI proxy and the Gateway API endpoint picker:
token ids -> who holds how much of the prompt in which tier (one index query) -> the policy's
choice among the routable instances.

Coverage per instance (``router.policies.Coverage``, tokens, cumulative): ``gpu`` what the
index says the instance's GPU holds (plus what the router sent there in the last
``speculative_s``: engine events lag a burst of the same prefix); ``dram`` adds what its
node's store holds; ``remote`` adds the best any other node's store holds.

Speculative holdings are kept in this router (keys of prompts it routed, by instance, for a
few seconds), not written to the index: the index takes writes only from a source's own event
stream with a cursor. Router replicas hear each other's through their shares (``peers.py``:
relayed by the index's change feed within a share interval), with each other's in-flight load
and ejections.

The index is asked through an ``IndexGate`` (``index_gate.py``): with a deadline
(``router.index_timeout_s``), past which the decision is made by load alone.

Threading: ``route`` may run on several threads; the speculative table has a lock, policies
are called under one (``sticky`` keeps a session table).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvtier.core.chunks import Tier
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.index.api import ChunkIndex, LocationKind, Query, QueryResult
from kvtier.index.client.replica import IndexReplica
from kvtier.router.backends import Backend, Backends, NoBackend
from kvtier.router.index_gate import IndexGate
from kvtier.router.peers import PeerShares
from kvtier.router.policies import Candidate, Coverage, Decision, Policy, RouteRequest
from kvtier.router.session_keys import SessionKeys

log = logging.getLogger(__name__)

NAMESPACE_RETRY_S = 1.0


@dataclass
class Routed:
    backend: Backend
    decision: Decision
    candidates: list[Candidate]
    prompt_tokens: int
    predicted_cached: int  # tokens the chosen instance holds on GPU or its node (coverage.dram)
    seconds: float  # the decision's own time (index query + scoring)
    by_tier: dict[str, int] = field(default_factory=dict)
    # The longest DRAM run of the prompt on a node other than the chosen instance's, in
    # tokens, as the index answered for this decision; None where the index did not answer.
    # Told to the instance (``engine_hint``): its connector skips its own index query when
    # no other node could extend what its node holds.
    elsewhere_tokens: int | None = None


class Speculative:
    """Chunk keys recently routed to each instance, forgotten after ``ttl_s``."""

    def __init__(self, ttl_s: float, max_keys: int = 1 << 20) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._keys: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, keys: Sequence[bytes], backend: str) -> None:
        if self.ttl_s <= 0:
            return
        expires = time.monotonic() + self.ttl_s
        with self._lock:
            for key in keys:
                self._keys[key] = (backend, expires)
                self._keys.move_to_end(key)
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)

    def leading(self, keys: Sequence[bytes], backend: str) -> int:
        """Leading chunks of ``keys`` routed to ``backend`` within the TTL."""
        if not self._keys:  # off (ttl 0) or nothing routed lately: no lock, no clock
            return 0
        now = time.monotonic()
        n = 0
        with self._lock:
            for key in keys:
                held = self._keys.get(key)
                if held is None or held[0] != backend or held[1] < now:
                    break
                n += 1
        return n


SPREAD_TAIL_TOKENS = 32  # enough of a prompt's end to tell prompts apart


def _spread_key(token_ids: Sequence[int] | None) -> str | None:
    """What a request without a session spreads ties by: its length and last tokens, which
    tell prompts apart (the user's turn ends them) where their first tokens would not (a
    shared system prompt would send every tie to one instance)."""
    if not token_ids:
        return None
    return f"{len(token_ids)}:{','.join(map(str, token_ids[-SPREAD_TAIL_TOKENS:]))}"


class RoutingCore:
    def __init__(
        self,
        backends: Backends,
        policy: Policy,
        index: ChunkIndex | None = None,
        speculative_s: float = 3.0,
        decision_log: Path | None = None,
        index_timeout_s: float | None = None,
        on_index_degraded: Callable[[str], None] | None = None,
    ) -> None:
        """``index_timeout_s``: deadline of each index call on the hot path (None: none, the
        index client's own timeout); ``on_index_degraded(reason)``: one missed it."""
        self.backends = backends
        self.policy = policy
        self.index = index
        self.gate = IndexGate(index_timeout_s, on_index_degraded)
        self.speculative = Speculative(speculative_s)
        self.session_keys = SessionKeys()  # a session's next turn hashes only its new chunks
        self.peers: PeerShares | None = None  # the other router replicas (router/peers.py)
        self._policy_lock = threading.Lock()
        self._namespaces: dict[bytes, Namespace] = {}
        self._list_after = 0.0  # next time an unknown namespace may make us list them
        self._log: IO[str] | None = decision_log.open("a") if decision_log else None
        self._log_lock = threading.Lock()

    def route(
        self,
        token_ids: Sequence[int] | None,
        prompt_tokens: int,
        session: str | None = None,
        exclude: set[str] | frozenset[str] = frozenset(),
        subset: set[str] | None = None,
        dispatch: bool = False,
    ) -> Routed:
        """Choose an instance. ``token_ids`` None: unknown (routing by load only);
        ``subset``: only these instance names or URLs may be chosen. Raises ``NoBackend``.

        ``dispatch``: count the request as the chosen instance's load (``Backends.dispatched``)
        before any other decision reads the loads. Decisions run on threads, side by side: a
        request counted only after ``route`` returned was invisible to a decision made in
        between, and two requests sent 0.12 s apart both went to one instance (``kvtier bench
        cluster``, docs/benchmarks-cluster.md run 8b). The caller then owes
        ``Backends.finished`` for it, whatever happens next."""
        start = time.perf_counter()
        backends = self.backends.routable(exclude)
        if subset is not None:
            backends = [b for b in backends if b.name in subset or _hostport(b.url) in subset]
            if not backends:
                raise NoBackend(False, "no healthy instance in the requested subset")
        coverage, keys_of, elsewhere = self._coverage(backends, token_ids, session)
        request = RouteRequest(prompt_tokens, session, _spread_key(token_ids))
        with self._policy_lock:  # loads read, choice made and (dispatch) counted as one
            candidates = [
                Candidate(b.name, b.load(), coverage.get(b.name, Coverage())) for b in backends
            ]
            decision = self.policy.choose(request, candidates)
            chosen = backends[decision.index]
            if dispatch:
                self.backends.dispatched(chosen, prompt_tokens)
        keys = keys_of.get(chosen.namespace or b"")
        if keys:
            self.speculative.record(keys, chosen.name)
            if self.peers is not None and chosen.namespace is not None:
                self.peers.routed(chosen.name, chosen.namespace, keys)
        cov = candidates[decision.index].coverage
        return Routed(
            chosen,
            decision,
            candidates,
            prompt_tokens,
            predicted_cached=min(cov.dram, prompt_tokens),
            seconds=time.perf_counter() - start,
            by_tier={"gpu": cov.gpu, "dram": cov.dram - cov.gpu, "remote": cov.remote - cov.dram},
            elsewhere_tokens=elsewhere.get(chosen.name),
        )

    # -- coverage ----------------------------------------------------------------------------

    def _coverage(
        self, backends: Sequence[Backend], token_ids: Sequence[int] | None, session: str | None
    ) -> tuple[dict[str, Coverage], dict[bytes, list[bytes]], dict[str, int]]:
        """Each backend's coverage; the prompt's chunk keys by namespace; and, for backends
        whose namespace the index answered for, the best DRAM run on another node (tokens)."""
        out: dict[str, Coverage] = {}
        keys_of: dict[bytes, list[bytes]] = {}
        elsewhere: dict[str, int] = {}
        if token_ids is None or self.index is None:
            return out, keys_of, elsewhere
        namespaces = sorted({b.namespace for b in backends if b.namespace is not None})
        if not namespaces:
            return out, keys_of, elsewhere
        for ns in namespaces:
            namespace = self._namespace(ns)
            if namespace is not None:  # keys here: 16 bytes a chunk on the wire, not 4 a token
                keys_of[ns] = self.session_keys.keys(namespace, ns, token_ids, session)
        queries = [
            Query(ns, keys=keys_of[ns]) if ns in keys_of else Query(ns, tokens=token_ids)
            for ns in namespaces
        ]
        if isinstance(self.index, IndexReplica) and self.index.fresh():
            results = self.index.copy.query(queries)  # in this process: no deadline needed
        else:  # None (past the deadline, failed): routing by load only, never an error
            results = self.gate.call("query", self.index.query, queries) or []
        by_ns = {r.ns_id: _Runs(r) for r in results}
        chunks = {ns: self.chunk_tokens(ns) for ns in namespaces}
        for b in backends:
            if b.namespace is None:
                continue
            chunk = chunks[b.namespace]
            runs = by_ns.get(b.namespace)
            gpu, dram, remote, disk = runs.of(b) if runs is not None else (0, 0, 0, 0)
            n = len(token_ids)
            if runs is not None and remote < n // chunk:
                # A run ends at the first chunk its node lacks: one that ends before the
                # keys asked about is the whole run there. One that reaches their end (a
                # prompt routed by its last turn) may go on: no word then.
                elsewhere[b.name] = remote * chunk
            keys = keys_of.get(b.namespace)
            if keys:
                gpu = max(gpu, self.speculative.leading(keys, b.name))
            # the node's disk counts past its DRAM run (a chunk in both is a DRAM hit)
            dram = max(dram, gpu)
            disk = disk if disk > dram else 0
            remote = max(remote, dram, disk)
            out[b.name] = Coverage(
                min(gpu * chunk, n),
                min(dram * chunk, n),
                min(remote * chunk, n),
                min(disk * chunk, n),
            )
        return out, keys_of, elsewhere

    def node_run(self, backend: Backend, token_ids: Sequence[int]) -> int:
        """Leading chunks of the prompt that ``backend``'s node pool holds, per the index
        (0 when it cannot say): what an offloaded prefill left there."""
        ns_id = backend.namespace
        if self.index is None or ns_id is None or not backend.node:
            return 0
        namespace = self._namespace(ns_id)
        if namespace is None:
            return 0
        keys = prompt_keys(namespace, token_ids)
        results = self.gate.call("query", self.index.query, [Query(ns_id, keys=keys)]) or []
        for result in results:
            holding = result.of(backend.node)
            if holding is not None:
                return holding.runs.get(Tier.CPU, 0)
        return 0

    def _namespace(self, ns_id: bytes) -> Namespace | None:
        """The namespace's definition, from the index's list. A namespace the index cannot
        define is asked about again at most every ``NAMESPACE_RETRY_S``: listing every
        namespace is not work for each request of the hot path."""
        namespace = self._namespaces.get(ns_id)
        now = time.monotonic()
        if namespace is None and self.index is not None and now >= self._list_after:
            self._list_after = now + NAMESPACE_RETRY_S
            known = self.gate.call("namespaces", self.index.namespaces, on_late=self._learn)
            if known is None:
                return None  # queried by token ids meanwhile; a late answer is kept
            self._learn(known)
            namespace = self._namespaces.get(ns_id)
        return namespace

    def _learn(self, known: dict[bytes, Namespace | None]) -> None:
        self._namespaces.update({k: v for k, v in known.items() if v is not None})

    def index_state(self) -> dict[str, Any]:
        """For ``/readyz``: ``index`` none (not configured), ok or degraded (and why); with a
        replica, ok while it is fresh (decisions read it), else what the direct queries met."""
        if self.index is None:
            return {"index": "none"}
        if isinstance(self.index, IndexReplica):
            replica = self.index.replica_state()
            state = {"index": "ok"} if replica["fresh"] else self.gate.state()
            peers = {"peers": self.peers.state()} if self.peers is not None else {}
            return {**state, "replica": replica, **peers}
        return self.gate.state()

    def chunk_tokens(self, ns_id: bytes) -> int:
        namespace = self._namespace(ns_id)
        return namespace.chunk_tokens if namespace is not None else 256

    # -- decision log ------------------------------------------------------------------------

    def log_decision(self, routed: Routed, outcome: dict[str, Any]) -> None:
        if self._log is None:
            return
        record = {
            "t": time.time(),
            "chosen": routed.backend.name,
            "reason": routed.decision.reason,
            "policy": self.policy.name,
            "prompt_tokens": routed.prompt_tokens,
            "decision_ms": round(routed.seconds * 1e3, 3),
            "candidates": [
                {
                    "name": c.name,
                    "score": routed.decision.scores[i] if routed.decision.scores else None,
                    "gpu": c.coverage.gpu,
                    "dram": c.coverage.dram,
                    "remote": c.coverage.remote,
                    "disk": c.coverage.disk,
                    "pending": c.load.pending_prefill_tokens,
                    "running": c.load.running,
                }
                for i, c in enumerate(routed.candidates)
            ],
            **outcome,
        }
        with self._log_lock:
            self._log.write(json.dumps(record) + "\n")
            self._log.flush()

    def close(self) -> None:
        if self.peers is not None:
            self.peers.close()
        self.gate.close()
        if self._log is not None:
            self._log.close()


class _Runs:
    """One answer of the index, indexed once for every candidate: by location, and the two
    nodes holding the longest DRAM runs (the best remote run of any instance is one of them)."""

    def __init__(self, result: QueryResult) -> None:
        self.by_location = {h.location: h for h in result.holdings}
        nodes = sorted(
            (
                (h.runs.get(Tier.CPU, 0), h.location)
                for h in result.holdings
                if h.kind is LocationKind.NODE
            ),
            reverse=True,
        )
        self.top_nodes = nodes[:2]

    def of(self, backend: Backend) -> tuple[int, int, int, int]:
        """(GPU run of the instance, DRAM run on its node, best DRAM run on another node, run
        on its node's disk) in chunks."""
        gpu = dram = remote = disk = 0
        own = self.by_location.get(backend.name)
        if own is not None and own.kind is not LocationKind.NODE:
            gpu = own.runs.get(Tier.GPU, 0)
            dram = own.runs.get(Tier.CPU, 0)  # the instance's own offload
        if backend.node:
            node = self.by_location.get(backend.node)
            if node is not None and node.kind is LocationKind.NODE:
                dram = max(dram, node.runs.get(Tier.CPU, 0))
                disk = node.runs.get(Tier.DISK, 0)
        for run, location in self.top_nodes:
            if not backend.node or location != backend.node:  # a store's name: its node
                remote = run
                break
        return gpu, dram, remote, disk


def _hostport(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")
