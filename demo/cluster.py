"""``kvtier demo`` (``make run``): a small cluster on this machine, and what kvtier is for.

Two "nodes" on loopback, each a node store and vLLM CPU instances with the kvtier connector,
the index, and the router in front (``testing/fleet.py``), on a random model generated here. One
prompt, four ways:

1. through the router, first time: a miss (computed);
2. through the router again: it goes back to the instance whose GPU cache holds it (GPU hit);
3. to another instance of the same node, which never saw it: read from the node's DRAM pool;
4. to an instance of the other node: pulled from the first node's pool (remote), then read.

Each is verified from that vLLM's own counters (``vllm:prompt_tokens_cached_by_source``:
device / host / p2p), each with its time to first token. Then the cluster keeps serving until
Ctrl-C, which stops every process and releases every shared-memory segment.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtier.testing.fleet import Fleet, FleetSpec, Instance, completion
from kvtier.testing.models import make_model
from kvtier.traces.server_metrics import parse_prometheus

SOURCES = ("device", "host", "p2p")
CACHED = "vllm:prompt_tokens_cached_by_source_total"


@dataclass
class Step:
    what: str
    instance: str
    ttft_s: float
    cached: dict[str, float]  # tokens by source, this request
    expect: str  # the source that must have served most of the prompt ('' = none: a miss)

    @property
    def ok(self) -> bool:
        if not self.expect:
            return sum(self.cached.values()) == 0
        return self.cached.get(self.expect, 0) > 0


def _counters(inst: Instance) -> dict[str, float]:
    text = httpx.get(f"{inst.url}/metrics", timeout=10).text
    values = parse_prometheus(text, keep_labels=("source",))
    return {s: values.get(f"{CACHED}{{source={s}}}", 0.0) for s in SOURCES}


def _measure(fleet: Fleet, target: Instance | None, prompt: str, what: str, expect: str) -> Step:
    """One request (through the router when ``target`` is None); the counters say who served."""
    instances = fleet.instances if target is None else [target]
    before = {i.name: _counters(i) for i in instances}
    url = fleet.router_url if target is None else target.url
    facts, ttft = completion(url, prompt)
    name = facts["served_by"] or (target.name if target else "?")
    inst = next(i for i in fleet.instances if i.name == name)
    after = _counters(inst)
    cached = {s: after[s] - before[name][s] for s in SOURCES}
    return Step(what, name, ttft, cached, expect)


def _wait_stored(fleet: Fleet, node: str, prompt_tokens: int, timeout_s: float = 30) -> None:
    """Until ``node``'s store has committed the prompt's chunks (saves are asynchronous)."""
    store = fleet.stores[node]
    want = prompt_tokens // fleet.spec.chunk_tokens
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = httpx.get(f"{store.http}/stats", timeout=5).json()
        if stats.get("chunks", 0) >= want:
            time.sleep(1.0)  # the index follows the store's events: give it a moment
            return
        time.sleep(0.2)


def words(n: int, vocab: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    return " ".join(f"t{rng.randrange(vocab - 4)}" for _ in range(n))


def run(
    workdir: Path | None = None,
    instances_per_node: int = 2,
    prompt_tokens: int = 2048,
    keep_running: bool = True,
    say: Callable[[str], None] = print,
) -> list[Step]:
    workdir = workdir or Path(tempfile.mkdtemp(prefix="kvtier-demo-"))
    say(f"kvtier demo: a cluster on this machine (working directory {workdir})")
    model = make_model(workdir / "model", "cpu-bench")
    spec = FleetSpec(
        nodes=2, instances_per_node=instances_per_node, pool="512MiB", kv_cache_bytes=64 << 20
    )
    fleet = Fleet(spec, model, workdir)
    try:
        start = time.monotonic()
        fleet.start(say)
        say(f"cluster up in {time.monotonic() - start:.0f} s")
        for i, inst in enumerate(fleet.instances):  # first-request costs (attaching the pool,
            completion(inst.url, words(64, 4096, seed=1000 + i))  # ...) stay out of the figures
        prompt = words(prompt_tokens - 1, 4096)
        steps = [_measure(fleet, None, prompt, "first time, through the router", "")]
        first = next(i for i in fleet.instances if i.name == steps[0].instance)
        steps.append(_measure(fleet, None, prompt, "again, through the router", "device"))
        _wait_stored(fleet, first.node, prompt_tokens)
        same_node = [i for i in fleet.instances if i.node == first.node and i is not first]
        other_node = [i for i in fleet.instances if i.node != first.node]
        if same_node:
            steps.append(
                _measure(fleet, same_node[0], prompt, "another instance, same node", "host")
            )
        if other_node:
            steps.append(
                _measure(fleet, other_node[0], prompt, "an instance of the other node", "p2p")
            )
        _report(steps, say)
        if keep_running:
            say("")
            say(f"the router keeps serving at {fleet.router_url} (OpenAI API). Try:")
            say(
                f"  curl {fleet.router_url}/v1/completions -H 'Content-Type: application/json' "
                f'-d \'{{"model": "tiny", "prompt": "t1 t2 t3", "max_tokens": 8}}\''
            )
            say(f"  curl {fleet.router_url}/metrics        # Ctrl-C stops the whole cluster")
            while True:
                time.sleep(1)
        return steps
    except KeyboardInterrupt:
        return []
    finally:
        fleet.stop()
        say("cluster stopped: every process ended, shared memory released")


def _report(steps: list[Step], say: Callable[[str], None]) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    table = Table(title="one prompt, four ways (tokens from vLLM's own counters)")
    for col in ("request", "instance", "TTFT ms", "GPU", "node DRAM", "remote", "as expected"):
        table.add_column(col, justify="right")
    for s in steps:
        table.add_row(
            s.what,
            s.instance,
            f"{s.ttft_s * 1e3:.0f}",
            f"{s.cached['device']:.0f}",
            f"{s.cached['host']:.0f}",
            f"{s.cached['p2p']:.0f}",
            "yes" if s.ok else "NO",
        )
    console().print(table)
