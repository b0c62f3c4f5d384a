"""Sessions and the infinite-cache prefix hit of every request, in one streaming pass.

``SessionTracker.observe`` is fed requests in file order and says, for each: its session, its
turn, how many of its leading blocks an infinite cache would hit, and how many of those hits
the same session had used before (intra-session) as opposed to only other sessions
(cross-session).

Session traces name their sessions. Mooncake traces do not, so sessions are derived
(``DERIVED_SESSIONS_RULE``): a multi-turn conversation sends its whole history again on every
turn, so turn n+1's prompt begins with every full block of turn n's prompt (turn n's last,
partial, block changes once the answer is appended). A request continues a session when

1. its cached prefix covers every full block of the latest request that used the prefix's
   last block, and
2. that last block has been used by that one session only, i.e. the match goes beyond the part
   several sessions share (a common system prompt or document).

Anything else opens a new session; its hits, if any, are cross-session by construction.

What a session has used is a union of root paths of the prompt tree (radix.py), so it is kept
as the path ends ("leaves") alone: one per session for a conversation, a few for an agent that
branches. A hit block is intra-session when it lies on one of those paths.

Threading: not thread-safe. Memory: a few bytes per distinct block and per session, nothing
per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.traces.blocks import GrowArray
from kvtier.traces.formats import TraceRequest
from kvtier.traces.radix import PrefixTree

DERIVED_SESSIONS_RULE = (
    "derived sessions (the trace has none): a request continues a session when its cached "
    "prefix covers every full block of that session's latest request through the prefix's "
    "last block and that block is used by no other session; otherwise it opens a new session"
)
EXPLICIT_SESSIONS_RULE = "sessions as named by the trace (session_id, turn)"

_NONE = -1  # block never used
_MULTI = -2  # block used by several sessions


@dataclass(frozen=True, slots=True)
class Observation:
    session: int  # dense session number, in order of first appearance
    turn: int  # 1 for a session's first request
    hit_blocks: int  # leading blocks an infinite cache holds (prefix hit)
    intra_blocks: int  # of hit_blocks, those this session had used before
    new_session: bool

    @property
    def cross_blocks(self) -> int:
        return self.hit_blocks - self.intra_blocks


class SessionTracker:
    def __init__(self, tree: PrefixTree, block_tokens: int, derive: bool) -> None:
        self.tree = tree
        self.index = tree.index
        self.block_tokens = block_tokens
        self.derive = derive
        self.rule = DERIVED_SESSIONS_RULE if derive else EXPLICIT_SESSIONS_RULE
        self._owner = self.index.array(np.int32, _NONE)
        # full blocks of the latest request through each block (derived sessions only)
        self._last_full = self.index.array(np.int32, 0) if derive else None
        self._leaf = GrowArray(np.int64, -1)  # session -> the end of the one path it used
        self._leaves: dict[int, list[int]] = {}  # sessions that used several paths
        self._names: dict[str, int] = {}
        self._turns = GrowArray(np.int32, 0)
        self.sessions = 0

    @property
    def distinct_blocks(self) -> int:
        return self.tree.distinct

    @classmethod
    def standalone(cls, block_tokens: int, derive: bool) -> SessionTracker:
        from kvtier.traces.blocks import BlockIndex

        return cls(PrefixTree(BlockIndex()), block_tokens, derive)

    def observe(self, req: TraceRequest, slots: np.ndarray | None = None) -> Observation:
        if slots is None:
            slots = self.index.slots(req.hash_ids)
        n = len(slots)
        hit = self.tree.known_prefix(slots)
        owner = self._owner.data
        session, new = self._session_of(req, slots, hit, owner)
        turns = self._turns.ensure(session + 1)
        turns[session] += 1
        turn = int(turns[session]) if req.turn is None else req.turn

        leaves = [] if new else self._leaves_of(session)
        intra = max((self.tree.common_prefix(f, slots, hit) for f in leaves), default=0)
        self.tree.insert(slots, hit)
        if n:
            if hit:
                known = slots[:hit]
                prior = owner[known]
                owner[known[(prior >= 0) & (prior != session)]] = _MULTI
            tail = slots[hit:]
            prior = owner[tail]
            owner[tail[prior == _NONE]] = session
            owner[tail[(prior >= 0) & (prior != session)]] = _MULTI
            if self._last_full is not None:
                self._last_full.data[slots] = req.input_length // self.block_tokens
            if intra < n:  # the request used a path the session had not: record its end
                kept = [f for f in leaves if not self._on_path(f, slots)]
                kept.append(int(slots[-1]))
                self._set_leaves(session, kept)
        return Observation(session, turn, hit, intra, new)

    def _on_path(self, leaf: int, slots: np.ndarray) -> bool:
        d = self.tree.depth(leaf)
        return d <= len(slots) and int(slots[d - 1]) == leaf

    def _leaves_of(self, session: int) -> list[int]:
        many = self._leaves.get(session)
        if many is not None:
            return many
        leaf = int(self._leaf.ensure(session + 1)[session])
        return [leaf] if leaf >= 0 else []

    def _set_leaves(self, session: int, leaves: list[int]) -> None:
        if len(leaves) == 1:
            self._leaves.pop(session, None)
            self._leaf.ensure(session + 1)[session] = leaves[0]
        else:
            self._leaves[session] = leaves

    def _session_of(
        self, req: TraceRequest, slots: np.ndarray, hit: int, owner: np.ndarray
    ) -> tuple[int, bool]:
        if not self.derive:
            assert req.session_id is not None
            known = self._names.get(req.session_id)
            if known is not None:
                return known, False
            self._names[req.session_id] = self.sessions
        elif hit:
            last = slots[hit - 1]
            holder = int(owner[last])
            assert self._last_full is not None
            if holder >= 0 and hit >= self._last_full.data[last]:
                return holder, False
        self.sessions += 1
        return self.sessions - 1, True
