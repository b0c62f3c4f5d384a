"""The router in front of real vLLM CPU servers: its token ids equal vLLM's, it serves
streaming and whole answers with every policy, and with the index it sends a prompt back to
the instance whose GPU holds it.

Two ``python -m vllm.entrypoints.openai.api_server`` processes with the kvtier connector and
KV events on; they announce themselves (with their API URL) to a ``kvtier index serve``
process, from which the router learns both the instances and what their GPUs hold."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvtier.core.config import IndexConfig
from kvtier.core.config.router import RouterConfig
from kvtier.core.http import HttpServer
from kvtier.index.client import connect as connect_index
from kvtier.router.engine_load import engine_load
from kvtier.router.policies import POLICIES
from kvtier.router.proxy import Proxy
from kvtier.router.service import build
from kvtier.router.tokenize import PromptTokenizer
from kvtier.testing.ports import free_port
from kvtier.testing.vllm_driver import kvtier_transfer_config
from kvtier.testing.vllm_server import MODEL_NAME, VllmServer

from support.helpers import start_index_process
from support.metrics_pages import full_parse

pytestmark = pytest.mark.vllm
CHUNK = 64


@dataclass
class Fleet:
    model: Path
    index_address: str
    servers: list[VllmServer]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from support.trace_vllm_server import build_tiny_model

    root = tmp_path_factory.mktemp("router-vllm")
    model = build_tiny_model(root / "tiny")
    index = start_index_process()
    servers: list[VllmServer] = []
    try:
        for name in ("vllm-a", "vllm-b"):
            port = free_port()
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{free_port()}",
                "replay_endpoint": f"tcp://*:{free_port()}",
            }
            extra = {
                "chunk_tokens": CHUNK,
                "index_address": index.address,
                "instance_id": name,
                "instance_api": f"http://127.0.0.1:{port}",
            }
            server = VllmServer(
                model,
                root / f"{name}.log",
                extra_args=[
                    "--kv-events-config", json.dumps(events),
                    "--kv-transfer-config", json.dumps(kvtier_transfer_config(extra)),
                ],
                env={"KVTIER_STORE__RUN_DIR": str(root / f"run-{name}")},
                port=port,
            )  # fmt: skip
            servers.append(server)
        for server in servers:
            server.wait_ready()
        yield Fleet(model, index.address, servers)
    finally:
        for server in servers:
            server.stop()
        index.stop()


@dataclass
class Router:
    url: str
    proxy: Proxy
    server: HttpServer


def start_router(fleet: Fleet, policy: str, log: Path | None = None) -> Router:
    config = RouterConfig(policy=policy, model=str(fleet.model), decision_log=log)
    index = connect_index(IndexConfig(address=fleet.index_address))
    app, proxy = build(config, index, probes=False)
    deadline = time.monotonic() + 60
    while len(proxy.backends) < 2 and time.monotonic() < deadline:  # both announced
        time.sleep(0.5)
        proxy.backends.refresh()
    assert len(proxy.backends) == 2
    server = HttpServer(app, "127.0.0.1", 0)
    return Router(f"http://127.0.0.1:{server.start()}", proxy, server)


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"t{rng.randrange(500)}" for _ in range(n))


def test_router_token_ids_equal_vllms(fleet: Fleet) -> None:
    tokenizer = PromptTokenizer(str(fleet.model))
    url = fleet.servers[0].url
    prompt = words(1, 200)
    theirs = httpx.post(f"{url}/tokenize", json={"model": MODEL_NAME, "prompt": prompt}).json()
    assert tokenizer.completion_ids(prompt) == theirs["tokens"]
    messages = [
        {"role": "user", "content": words(2, 50)},
        {"role": "assistant", "content": words(3, 20)},
        {"role": "user", "content": [{"type": "text", "text": words(4, 30)}]},
    ]
    body = {"model": MODEL_NAME, "messages": messages}
    theirs = httpx.post(f"{url}/tokenize", json=body).json()
    assert tokenizer.chat_ids(body) == theirs["tokens"]
    # a growing conversation, tokenized incrementally per session, still matches
    for turn in range(3):
        messages = [*messages, {"role": "user", "content": words(10 + turn, 40)}]
        body = {"model": MODEL_NAME, "messages": messages}
        theirs = httpx.post(f"{url}/tokenize", json=body).json()
        assert tokenizer.chat_ids(body, session="s") == theirs["tokens"]
    assert tokenizer.sessions.reused_tokens > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_serves_real_instances(fleet: Fleet, policy: str) -> None:
    router = start_router(fleet, policy)
    try:
        body = {"model": MODEL_NAME, "prompt": words(5, 100), "max_tokens": 4, "temperature": 0}
        whole = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
        assert whole.status_code == 200, whole.text
        text = whole.json()["choices"][0]["text"]
        with httpx.stream(
            "POST", f"{router.url}/v1/completions", json={**body, "stream": True}, timeout=120
        ) as resp:
            events = [
                json.loads(line[6:])
                for line in resp.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        assert "".join(e["choices"][0]["text"] for e in events) == text  # greedy: same answer
        chat = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": words(6, 60)}],
            "max_tokens": 3,
        }
        resp = httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=120)
        assert resp.status_code == 200, resp.text
    finally:
        router.server.stop()


def test_a_prompt_goes_back_to_the_instance_whose_gpu_holds_it(
    fleet: Fleet, tmp_path: Path
) -> None:
    log = tmp_path / "decisions.jsonl"
    router = start_router(fleet, "kvtier", log)
    try:
        prompt = words(7, 600)  # 9 full chunks of 64 tokens
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=120).is_success
        first = json.loads(log.read_text().splitlines()[-1])["chosen"]
        time.sleep(router.proxy.core.speculative.ttl_s + 3)  # only the index can say it now
        assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=120).is_success
        second = json.loads(log.read_text().splitlines()[-1])
        assert second["chosen"] == first
        held = {c["name"]: c["gpu"] for c in second["candidates"]}
        assert held[first] >= 9 * CHUNK and held[first] > max(
            v for k, v in held.items() if k != first
        )
    finally:
        router.server.stop()


def test_the_load_read_from_a_live_vllm_page_equals_a_full_parse(fleet: Fleet) -> None:
    """``engine_load`` reads three gauges off the page; the full parse it replaced reads all
    of it: the same numbers from a vLLM serving a request (so running is not 0)."""
    url = fleet.servers[0].url
    # generating until the stream is closed below: a random model may sample its end-of-text
    # token early (a request finished before vLLM published it running read running=0)
    body = {
        "model": MODEL_NAME, "prompt": words(8, 50), "max_tokens": 1500, "ignore_eos": True,
        "stream": True,
    }  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        while not next(lines).startswith("data: "):  # generating now
            pass
        # vLLM's front end publishes the engine's gauges a little after the first token
        deadline = time.monotonic() + 10
        page = httpx.get(f"{url}/metrics", timeout=10).text
        while engine_load(page).running == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
            page = httpx.get(f"{url}/metrics", timeout=10).text
    load = engine_load(page)
    assert load == full_parse(page)
    assert load.running == 1
