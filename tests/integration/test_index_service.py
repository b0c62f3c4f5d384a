"""``kvtier index serve`` as a real process: gRPC with the typed client, HTTP for people and
Prometheus, the CLI, and bad input answered with clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest

from kvtier.core.chunks import Tier
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.index.api import (
    ApplyStatus,
    ChunkOp,
    HeartbeatStatus,
    LocationKind,
    Query,
    Registration,
)
from kvtier.index.client.grpc import GrpcIndexClient
from kvtier.index.ingest.vllm_wire import BlockStored
from kvtier.index.proto import index_pb2 as pb
from kvtier.index.proto import index_pb2_grpc
from kvtier.store.api.events import EventKind

from support.helpers import IndexProcess, free_port, http_json, start_index_process
from support.vllm_fixtures import FaultyPublisher, wait_for

NS = Namespace(model="m", dtype="bf16", num_layers=4, num_kv_heads=2, head_size=64, chunk_tokens=16)
TOKENS = list(range(1000, 1000 + 5 * 16 + 3))


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[IndexProcess, FaultyPublisher]]:
    """One index process following one (wire-exact) vLLM publisher, for the module."""
    port, replay = free_port(), free_port()
    pub = FaultyPublisher(port, replay)
    source = {
        "instance": "vllm-0",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "topic": "kv",
        "namespaces": [NS.model_dump()],
        "node": "node-a",
    }
    proc = start_index_process("--vllm", json.dumps(source), "--probe-interval", "0.2")
    try:
        yield proc, pub
    finally:
        assert proc.stop() == 0
        pub.close()


@pytest.fixture
def client(served) -> Iterator[GrpcIndexClient]:
    c = GrpcIndexClient(served[0].address)
    yield c
    c.close()


def test_follows_vllm_and_answers_over_grpc_and_http(served, client: GrpcIndexClient) -> None:
    proc, pub = served
    event = BlockStored(
        block_hashes=list(range(1, 6)), parent_block_hash=None, token_ids=TOKENS[:80],
        block_size=16, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    pub.publish([event])
    ns_id = NS.root_key()
    result = wait_for(
        lambda: (r := client.query_one(Query(ns_id, tokens=TOKENS))).holdings and r,
        what="the engine's blocks",
    )
    (h,) = result.holdings
    assert (h.location, h.kind, h.node, dict(h.runs), h.total) == (
        "vllm-0",
        LocationKind.INSTANCE,
        "node-a",
        {Tier.GPU: 5},
        5,
    )
    assert client.query_tokens(NS, TOKENS).holdings == result.holdings
    # HTTP: the same answer as JSON, single and batched
    status, body = http_json(f"{proc.http}/query", {"ns": ns_id.hex(), "tokens": TOKENS})
    assert status == 200 and body["holdings"][0]["runs"] == {"gpu": 5}
    keys = [k.hex() for k in prompt_keys(NS, TOKENS)[:2]]
    status, body = http_json(
        f"{proc.http}/query",
        {"queries": [{"ns": ns_id.hex(), "keys": keys}, {"ns": ns_id.hex(), "tokens": []}]},
    )
    assert status == 200 and [a["num_chunks"] for a in body["answers"]] == [2, 0]
    assert body["answers"][0]["holdings"][0]["total"] == 2
    assert http_json(f"{proc.http}/healthz") == (200, {"status": "ok"})
    status, ready = http_json(f"{proc.http}/readyz")
    assert status == 200 and ready["status"] == "ready"
    status, metrics = http_json(f"{proc.http}/metrics")
    assert status == 200
    for line in (
        'kvtier_index_events_total{kind="vllm",source="vllm-0",type="BlockStored"} 1.0',
        'kvtier_index_entries{tier="gpu"} 5.0',
        'kvtier_index_vllm_blocks_total{source="vllm-0"} 5.0',
        'kvtier_index_gaps_total{outcome="recovered",source="vllm-0"} 0.0',
        'kvtier_index_locations{status="up"} 1.0',
        "kvtier_index_query_seconds_bucket",
        "kvtier_index_degraded 0.0",
    ):
        assert line in metrics, line
    stats = client.stats()
    assert stats["sources"][0]["state"] == "live" and stats["backend"]["entries_gpu"] == 5


def test_registration_heartbeats_and_pushed_entries(client: GrpcIndexClient) -> None:
    ns_id = client.register_namespace(NS)
    store_ns = client.register_namespace(b"\x07" * 16)
    assert client.namespaces()[ns_id] == NS and client.namespaces()[store_ns] is None
    info = client.register(Registration("node-b", LocationKind.NODE, (ns_id,), node="node-b"))
    assert info.registration.kind is LocationKind.NODE
    keys = prompt_keys(NS, TOKENS)
    op = ChunkOp(EventKind.STORED, Tier.CPU, ns_id, tuple(keys[:3]))
    assert client.apply("node-b", [op]) is ApplyStatus.APPLIED
    client.replace("node-b", {Tier.CPU: {ns_id: keys}}, epoch=5, seq=9)
    assert client.apply("node-b", [op], epoch=5, seq_from=9, seq_to=9) is ApplyStatus.DUPLICATE
    assert client.heartbeat(["node-b", "nobody"]) == [HeartbeatStatus.OK, HeartbeatStatus.UNKNOWN]
    result = client.query_one(Query(ns_id, keys=keys))
    assert result.of("node-b").runs == {Tier.CPU: 5}
    assert client.drop("node-b") and client.query_one(Query(ns_id, keys=keys)).of("node-b") is None
    assert client.heartbeat(["node-b"]) == [HeartbeatStatus.RESYNC]
    assert client.claim("node-b", "me", 1.0)
    assert client.unregister("node-b")
    assert "node-b" not in [i.registration.location for i in client.locations()]


def test_bad_input_gets_clear_errors(served, client: GrpcIndexClient) -> None:
    proc, _ = served
    ns_id = client.register_namespace(NS)
    keys = tuple(prompt_keys(NS, TOKENS))

    def code(fn, *args, **kwargs) -> ErrorCode:
        with pytest.raises(KvtierError) as err:
            fn(*args, **kwargs)
        return err.value.code

    stored = ChunkOp(EventKind.STORED, Tier.GPU, ns_id, keys)
    assert code(client.apply, "ghost", [stored]) is ErrorCode.UNKNOWN_LOCATION
    client.register(Registration("x", LocationKind.INSTANCE, (ns_id,)))
    bad_ns = ChunkOp(EventKind.STORED, Tier.GPU, b"\x01" * 16, keys)
    assert code(client.apply, "x", [stored, bad_ns]) is ErrorCode.UNKNOWN_NAMESPACE
    assert client.query_one(Query(ns_id, keys=keys)).of("x") is None  # nothing applied
    assert code(client.query_one, Query(b"\x02" * 16, keys=keys)) is ErrorCode.UNKNOWN_NAMESPACE
    assert code(client.query_one, Query(ns_id, tokens=[-5])) is ErrorCode.INVALID_ARGUMENT
    assert code(client.query_one, Query(ns_id, keys=[b"short"])) is ErrorCode.INVALID_ARGUMENT
    unregistered = Registration("y", LocationKind.NODE, (b"\x03" * 16,))
    assert code(client.register, unregistered) is ErrorCode.UNKNOWN_NAMESPACE
    # what a client of another language could send
    with grpc.insecure_channel(proc.address) as channel:
        stub = index_pb2_grpc.IndexStub(channel)
        bad_keys = pb.ChunkOp(kind="stored", tier="gpu", ns_id=ns_id, keys=b"abc")
        for request, method in [
            (pb.ApplyRequest(location="x", ops=[pb.ChunkOp(kind="teleported")]), "Apply"),
            (pb.ApplyRequest(location="x", ops=[pb.ChunkOp(kind="stored", tier="tape")]), "Apply"),
            (pb.ApplyRequest(location="x", ops=[bad_keys]), "Apply"),
            (
                pb.RegisterRequest(registration=pb.Registration(location="z", kind="toy")),
                "Register",
            ),
            (pb.RegisterNamespaceRequest(namespace_json="{not json"), "RegisterNamespace"),
            (pb.ReapRequest(timeout_s=-1), "Reap"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                getattr(stub, method)(request, timeout=5)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (method, request)
    # and over HTTP
    status, body = http_json(f"{proc.http}/query", {"ns": "zz"})
    assert status == 400 and body["code"] == "INVALID_ARGUMENT"
    status, body = http_json(f"{proc.http}/query", {"ns": "00" * 16, "tokens": [1]})
    assert status == 404 and body["code"] == "UNKNOWN_NAMESPACE"
    status, body = http_json(f"{proc.http}/query", [1, 2])
    assert status == 400
    assert client.unregister("x")


def test_cli_query_and_stats(served) -> None:
    proc, _ = served

    def kvtier(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "kvtier", "index", *args, "--address", proc.address],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    ns = NS.root_key().hex()
    out = kvtier("query", "--ns", ns, "--tokens", ",".join(map(str, TOKENS)), "--json")
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["holdings"][0]["location"] == "vllm-0" and answer["num_chunks"] == 5
    table = kvtier("query", "--ns", ns, "--tokens", json.dumps(TOKENS))
    assert table.returncode == 0 and "vllm-0" in table.stdout
    stats = kvtier("stats", "--json")
    assert stats.returncode == 0 and json.loads(stats.stdout)["sources"][0]["source"] == "vllm-0"
    assert kvtier("stats").returncode == 0
    bad = kvtier("query", "--ns", "00" * 16, "--tokens", "1,2")
    assert bad.returncode == 1 and "UNKNOWN_NAMESPACE" in bad.stderr


def test_unreachable_index_is_unavailable() -> None:
    client = GrpcIndexClient(f"127.0.0.1:{free_port()}", timeout_s=2)
    with pytest.raises(KvtierError) as err:
        client.query_one(Query(NS.root_key(), keys=[]))
    assert err.value.code is ErrorCode.UNAVAILABLE
    client.close()


def test_registering_endpoints_makes_the_index_follow(client: GrpcIndexClient) -> None:
    """A connector registers its engine's event endpoints: the index follows it, and stops
    when it unregisters."""
    port, replay = free_port(), free_port()
    pub = FaultyPublisher(port, replay)
    try:
        ns_id = client.register_namespace(NS)
        endpoints = {"events": f"tcp://127.0.0.1:{port}", "replay": f"tcp://127.0.0.1:{replay}",
                     "topic": "kv"}  # fmt: skip
        client.register(
            Registration("vllm-dyn", LocationKind.INSTANCE, (ns_id,), "node-c", endpoints)
        )
        event = BlockStored(
            block_hashes=[101, 102], parent_block_hash=None, token_ids=TOKENS[:32],
            block_size=16, lora_id=None, medium="GPU", lora_name=None,
        )  # fmt: skip
        pub.publish([event])
        result = wait_for(
            lambda: (r := client.query_one(Query(ns_id, tokens=TOKENS))).of("vllm-dyn") and r,
            what="the registered engine followed",
        )
        assert result.of("vllm-dyn").runs == {Tier.GPU: 2}
        assert "vllm-dyn" in [s["source"] for s in client.stats()["sources"]]
        assert client.unregister("vllm-dyn")
        wait_for(
            lambda: "vllm-dyn" not in [s["source"] for s in client.stats()["sources"]],
            what="following stopped",
        )
        assert "vllm-dyn" not in [i.registration.location for i in client.locations()]
    finally:
        pub.close()


BLOCK_IMPORTS = """
import sys

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "torch"):
            raise ImportError(f"{name} is not installed here (the index must not need it)")
        return None

sys.meta_path.insert(0, _Blocked())
"""


def test_the_index_runs_without_vllm_or_torch(tmp_path) -> None:
    """The service decodes vLLM's events itself: with vllm and torch unimportable it still
    follows an engine."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_IMPORTS)
    port, replay = free_port(), free_port()
    pub = FaultyPublisher(port, replay)
    source = {"instance": "vllm-x", "endpoint": f"tcp://127.0.0.1:{port}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv",
              "namespaces": [NS.model_dump()]}  # fmt: skip
    proc = start_index_process("--vllm", json.dumps(source), "--probe-interval", "0.2",
                               env={"PYTHONPATH": str(tmp_path)})  # fmt: skip
    client = GrpcIndexClient(proc.address)
    try:
        event = BlockStored(
            block_hashes=[7, 8, 9], parent_block_hash=None, token_ids=TOKENS[:48],
            block_size=16, lora_id=None, medium="GPU", lora_name=None,
        )  # fmt: skip
        pub.publish([event])
        wait_for(
            lambda: (
                (h := client.query_one(Query(NS.root_key(), tokens=TOKENS)).of("vllm-x"))
                and h.total == 3
            ),
            what="the engine followed without vLLM",
        )
    finally:
        client.close()
        assert proc.stop() == 0
        pub.close()
    check = subprocess.run(
        [sys.executable, "-c", "import vllm"], env={"PYTHONPATH": str(tmp_path)},
        capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode != 0 and "must not need it" in check.stderr  # the blocker works
