"""The router's word (``kvtier.core.engine_hint``) through vLLM's real ``Scheduler``: with the
remote tier configured, requests whose word rules out other nodes never ask the index, in
the hook order the engine uses, side by side, one of them aborted and one hitting the
vLLM's own prefix hit first; a request without a word asks as before. Every token computed or loaded
is checked (``EngineRig.wrong``)."""

from __future__ import annotations

from pathlib import Path

from support.engine_rig import EngineRig

CHUNK = 32
WORD = {"kvtier": {"elsewhere_tokens": 0}}  # no other node holds any of the prompt


def test_worded_requests_skip_the_index_side_by_side(tmp_path: Path) -> None:
    from kvtier.core.config.index import IndexConfig
    from kvtier.index.server.service import IndexService

    index = IndexService.start(
        IndexConfig(grpc_host="127.0.0.1", grpc_port=0, http_host="127.0.0.1", http_port=0)
    )
    rig = EngineRig(
        tmp_path,
        chunk_tokens=CHUNK,
        num_blocks=40,
        extra={
            "tiers": ["cpu", "remote"],
            "min_hit_tokens": {"cpu": CHUNK, "remote": CHUNK},
            "index_address": index.grpc_address,
        },
    )
    resolver = rig.connector.scheduler.resolver
    remote = next(t for t in resolver.staging if t.name == "remote")
    queries: list[int] = []
    real_query = remote.index.query_one
    remote.index.query_one = lambda q: queries.append(1) or real_query(q)
    try:
        seed = list(range(7, 7 + 4 * CHUNK + 1))
        rig.add("seed", seed, max_tokens=2).kv_transfer_params = WORD
        rig.run()  # its chunks saved in the node's pool
        rig.settle()
        prompts = {
            "past-a-hit": seed[:-1] + list(range(900, 900 + 2 * CHUNK)),  # looked up past a hit
            "miss-a": list(range(2000, 2000 + 3 * CHUNK + 5)),
            "miss-b": list(range(3000, 3000 + 5 * CHUNK + 3)),
            "aborted": list(range(4000, 4000 + 4 * CHUNK + 7)),
        }
        for req_id, prompt in prompts.items():
            rig.add(req_id, prompt, max_tokens=6).kv_transfer_params = WORD
        rig.step()
        rig.abort("aborted")
        rig.run()
        assert queries == []  # not one index query for a worded request
        assert rig.counters.get("remote_hint_skips", 0) >= 4
        assert all(rig.outputs_of(r) for r in prompts if r != "aborted")
        rig.add("no-word", list(range(5000, 5000 + 3 * CHUNK + 1)), max_tokens=2)
        rig.run()
        assert len(queries) >= 1  # asked, as without the router
        assert rig.wrong == []
    finally:
        rig.close()
        index.stop()
