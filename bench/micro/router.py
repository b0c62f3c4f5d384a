"""What one routing decision costs: tokenize + chunk keys + index query + score.

    kvtier bench router [--backends 16] [--max-tokens 32768] [--turn-tokens 1024]

An agentic session grows by ``--turn-tokens`` a turn up to ``--max-tokens``; each turn is a
chat request the router tokenizes (incrementally, per session), keys, looks up in the index
(16 instances registered with a real ``kvtier index serve`` process, half of them holding part
of the prompt on GPU, their nodes' stores holding more) and scores with the policy. Each
decision is made twice, in alternating order, by the same router state: asking the index
over gRPC ("index queried") and reading the router's replica of it, kept current from the
index's change feed ("index replica"). The proxy's default is a third: a turn that extends
its session's last one is routed by that turn's ids and an estimated length ("routed by the
last turn", ``router.route_by_last_turn``), and tokenized after routing, off the request's
path (timed here as "tokenize", not part of that decision). Reported at the longest prompts, p50/p99
of each step and of the whole decision, beside floors measured in the same run: tokenizing
the whole conversation from scratch, a bare index round trip, and the replica's query alone.

Also timed: reading one instance's load off a ``/metrics`` page shaped like vLLM 0.32's (one
engine: ~1,000 lines, ~80 KB), which the router does for every instance every
``router.scrape_s`` on the event loop its decisions run on: ``engine_load`` beside the full
``prometheus_client`` parse it replaced (tests/engine/test_router_vllm.py compares the two on a
live page).

The tokenizer is a byte-level BPE trained here on synthetic text (no downloads): what a real
model's tokenizer costs per character, within a small factor.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from kvtier.core.chunks import Tier
from kvtier.core.config.router import BackendConfig, RouterConfig
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.index.api import ChunkOp, LocationKind, Query, Registration
from kvtier.index.client.grpc import GrpcIndexClient
from kvtier.index.client.replica import IndexReplica
from kvtier.router.backends import Backends
from kvtier.router.core import RoutingCore
from kvtier.router.policies import make_policy
from kvtier.router.tokenize import PromptTokenizer
from kvtier.store.api.events import EventKind
from kvtier.testing.services import Service, _start

WORDS = [
    "".join(
        random.Random(i).choices("abcdefghijklmnopqrstuvwxyz", k=random.Random(-i).randint(2, 9))
    )
    for i in range(5000)
]


def make_tokenizer(out: Path, vocab: int = 32000) -> Path:
    """A byte-level BPE with a chat template, saved as a model directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choices(WORDS, k=200)) for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"])
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ '<s>' + m['role'] + '\\n' + m['content'] + '</s>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
    )
    fast.save_pretrained(out)
    return out


def _text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choices(WORDS, k=int(tokens / 1.6)))  # ~1.6 tokens a word here


def _populate(index: GrpcIndexClient, ns: Namespace, backends: int, ids: list[int]) -> bytes:
    """Instances i0..iN on nodes of 4; every other instance holds a share of the prompt."""
    ns_id = index.register_namespace(ns)
    keys = prompt_keys(ns, ids)
    for node in range((backends + 3) // 4):
        name = f"node{node}"
        index.register(Registration(name, LocationKind.NODE))
        held = keys[: len(keys) * (node + 1) // ((backends + 3) // 4 + 1)]
        index.apply(name, [ChunkOp(EventKind.STORED, Tier.CPU, ns_id, tuple(held))])
    for i in range(backends):
        name = f"i{i:02d}"
        index.register(Registration(name, LocationKind.INSTANCE, (ns_id,), node=f"node{i // 4}"))
        if i % 2 == 0:
            held = keys[: len(keys) * (i + 1) // (backends + 1)]
            index.apply(name, [ChunkOp(EventKind.STORED, Tier.GPU, ns_id, tuple(held))])
    return ns_id


def _pcts(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50_ms": statistics.median(ordered) * 1e3, "p99_ms": p99 * 1e3, "n": len(ordered)}


def run(
    backends: int = 16,
    max_tokens: int = 32768,
    turn_tokens: int = 1024,
    sessions: int = 8,
    policy: str = "kvtier",
    tail_tokens: int | None = None,
) -> dict:
    """Decisions at prompts of ``tail_tokens`` (default: 3/4 of ``max_tokens``) up to
    ``max_tokens`` are the ones reported."""
    tail_tokens = tail_tokens if tail_tokens is not None else max_tokens * 3 // 4
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-router-") as tmp:
        model = make_tokenizer(Path(tmp) / "tok")
        tokenizer = PromptTokenizer(str(model))
        index_service: Service = _start(["index", "serve", "--grpc-port", "0", "--http-port", "0"])
        try:
            index = GrpcIndexClient(index_service.address)
            ns = Namespace(
                model="bench", dtype="bf16", num_layers=32, num_kv_heads=8, head_size=128
            )
            rng = random.Random(1)
            system = _text(rng, max_tokens // 2)  # a long shared system prompt, half held
            shared_ids = tokenizer.chat_ids({"messages": [{"role": "system", "content": system}]})
            _populate(index, ns, backends, shared_ids)
            names = [f"i{b:02d}" for b in range(backends)]
            config = RouterConfig(
                policy=policy,
                backends=[BackendConfig(url=f"http://{n}.invalid:8000", name=n) for n in names],
            )
            table = Backends(config, index)  # refresh() learns their namespaces and nodes
            table.refresh()
            replica = IndexReplica(GrpcIndexClient(index_service.address), max_stale_s=60)
            while not (replica.fresh() and replica.seq and replica.copy.locations()):
                time.sleep(0.05)  # the snapshot of what _populate wrote
            cores = {
                "index queried": RoutingCore(table, make_policy(policy), index, speculative_s=0),
                "index replica": RoutingCore(table, make_policy(policy), replica, speculative_s=0),
            }
            # the proxy's default (router.route_by_last_turn): routed by the last turn's ids,
            # the new turn tokenized after routing, off the request's path
            by_last_turn = RoutingCore(table, make_policy(policy), replica, speculative_s=0)
            steps: dict[str, list[float]] = {"tokenize": []}
            for mode in cores:
                steps[f"route, {mode}"], steps[f"decision, {mode}"] = [], []
            steps["decision, index replica, routed by the last turn"] = []
            floors: dict[str, list[float]] = {
                "tokenize_whole": [],
                "index_round_trip": [],
                "replica_query": [],
            }
            turns = max_tokens // turn_tokens
            with tqdm(total=sessions * turns, desc="decisions", unit="req") as bar:
                for s in range(sessions):
                    messages = [{"role": "system", "content": system}]
                    for _ in range(turns):
                        messages.append({"role": "user", "content": _text(rng, turn_tokens)})
                        body = {"messages": messages}
                        start = time.perf_counter()
                        last = tokenizer.last_turn_ids(body, f"s{s}")
                        if last is not None:
                            by_last_turn.route(last[0], last[1], f"s{s}")
                        t_last = time.perf_counter() - start
                        start = time.perf_counter()
                        ids = tokenizer.chat_ids(body, f"s{s}")  # (after routing, in the proxy)
                        t_tok = time.perf_counter() - start
                        if len(ids) > max_tokens:
                            bar.update(1)
                            continue
                        order = list(cores.items())
                        if len(ids) % 2:  # alternate which goes first
                            order.reverse()
                        t_route = {}
                        for mode, core in order:
                            start = time.perf_counter()
                            core.route(ids, len(ids), f"s{s}")
                            t_route[mode] = time.perf_counter() - start
                        if len(ids) >= tail_tokens:
                            steps["tokenize"].append(t_tok)
                            if last is not None:
                                steps["decision, index replica, routed by the last turn"].append(
                                    t_last
                                )
                            for mode, seconds in t_route.items():
                                steps[f"route, {mode}"].append(seconds)
                                steps[f"decision, {mode}"].append(t_tok + seconds)
                            start = time.perf_counter()
                            tokenizer.chat_ids(body)  # floor: the whole conversation, again
                            floors["tokenize_whole"].append(time.perf_counter() - start)
                            query = [Query(ns.root_key(), keys=prompt_keys(ns, ids))]
                            start = time.perf_counter()
                            index.query(query)  # floor: one bare index round trip
                            floors["index_round_trip"].append(time.perf_counter() - start)
                            start = time.perf_counter()
                            replica.copy.query(query)  # floor: the replica's lookup alone
                            floors["replica_query"].append(time.perf_counter() - start)
                        bar.update(1)
                        messages.append({"role": "assistant", "content": _text(rng, 64)})
            index.close()
            replica.close()
        finally:
            index_service.stop()
    return {
        "backends": backends,
        "policy": policy,
        "prompt_tokens": f"{tail_tokens}..{max_tokens}",
        "steps": {k: _pcts(v) for k, v in steps.items() if v},
        "floors": {k: _pcts(v) for k, v in floors.items() if v},
        "budget_ms": 2.0,
        "scrape": scrape_cost(),
    }


def vllm_shaped_page() -> str:
    """A ``/metrics`` page with the families of vLLM 0.32's (one engine): 107 gauges, 78
    counters, 18 histograms, the three load gauges among them."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    labels = {"engine": "0", "model_name": "tiny"}
    buckets = [0.001 * 2**i for i in range(16)]
    for i in range(104):
        Gauge(f"vllm:gauge_{i}", "a gauge", list(labels), registry=registry).labels(**labels)
        if i % 35 == 0:
            name = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")[i // 35]
            gauge = Gauge(f"vllm:{name}", "load", list(labels), registry=registry)
            gauge.labels(**labels).set((3, 2, 0.4)[i // 35])
    for i in range(78):
        Counter(f"vllm:counter_{i}", "a counter", list(labels), registry=registry).labels(**labels)
    for i in range(18):
        Histogram(f"vllm:hist_{i}", "a histogram", list(labels), buckets=buckets,
                  registry=registry).labels(**labels).observe(0.01 * i)  # fmt: skip
    return generate_latest(registry).decode()


def scrape_cost(rounds: int = 200) -> dict:
    """Seconds to read the load off one page: ``engine_load`` and the full parse, interleaved."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.router.engine_load import engine_load

    page = vllm_shaped_page()
    times: dict[str, list[float]] = {"engine_load": [], "full parse (before)": []}
    for _ in range(rounds):
        start = time.perf_counter()
        engine_load(page)
        times["engine_load"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for family in text_string_to_metric_families(page):
            list(family.samples)
        times["full parse (before)"].append(time.perf_counter() - start)
    return {
        "page_lines": page.count("\n"),
        "page_bytes": len(page),
        "reads": {k: _pcts(v) for k, v in times.items()},
    }


def print_report(report: dict) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    table = Table(
        title=f"routing decision, {report['backends']} instances, prompts of "
        f"{report['prompt_tokens']} tokens ({report['policy']}; budget p99 <= "
        f"{report['budget_ms']} ms)"
    )
    for col in ("step", "p50 ms", "p99 ms", "n"):
        table.add_column(col, justify="right")
    for label, rows in (("", report["steps"]), ("floor: ", report["floors"])):
        for name, row in rows.items():
            table.add_row(
                label + name, f"{row['p50_ms']:.3f}", f"{row['p99_ms']:.3f}", str(row["n"])
            )
    console().print(table)
    scrape = report.get("scrape")
    if scrape:
        table = Table(
            title=f"reading an instance's load off its /metrics page ({scrape['page_lines']} "
            f"lines, {scrape['page_bytes'] / 1024:.0f} KiB), on the router's event loop, per "
            "instance per router.scrape_s"
        )
        for col in ("reader", "p50 ms", "p99 ms"):
            table.add_column(col, justify="right")
        for name, row in scrape["reads"].items():
            table.add_row(name, f"{row['p50_ms']:.3f}", f"{row['p99_ms']:.3f}")
        console().print(table)
