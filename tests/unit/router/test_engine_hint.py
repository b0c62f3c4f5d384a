"""The router's word to the instance it chose (``kvtier.core.engine_hint``): the best run of
the prompt on another node, as the index answered the decision, carried in the request's
``kv_transfer_params``. Given only where the index's answer bounds that run; replacing what a
client wrote under the key; appended without re-encoding the prompt. What the connector does
with it: tests/integration/test_connector_known_miss.py."""

from __future__ import annotations

import json

import pytest

from kvtier.core import engine_hint
from kvtier.core.chunks import Tier
from kvtier.core.config.router import BackendConfig, RouterConfig
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.index.api import ChunkOp, LocationKind, Registration
from kvtier.index.backends.memory import MemoryIndex
from kvtier.router.backends import Backends
from kvtier.router.core import RoutingCore
from kvtier.router.policies import make_policy
from kvtier.router.requests import with_engine_hint
from kvtier.store.api.events import EventKind

NS = Namespace(model="m", dtype="bf16", num_layers=1, num_kv_heads=1, head_size=8)
CHUNK = NS.chunk_tokens
PROMPT = list(range(3, 3 + CHUNK * 4 + 5))  # four whole chunks and a few tokens


def _core(held_on_n1: int) -> RoutingCore:
    """i0 on node n0, i1 on node n1; n1's pool holds the prompt's first ``held_on_n1``
    chunks."""
    index = MemoryIndex()
    ns_id = index.register_namespace(NS)
    reader = {engine_hint.READER_ENDPOINT: engine_hint.READER}  # i0's connector reads words
    for name, node, endpoints in (("i0", "n0", reader), ("i1", "n1", {})):
        index.register(
            Registration(name, LocationKind.INSTANCE, (ns_id,), node=node, endpoints=endpoints)
        )
    for node in ("n0", "n1"):
        index.register(Registration(node, LocationKind.NODE, (ns_id,)))
    keys = tuple(prompt_keys(NS, PROMPT)[:held_on_n1])
    if keys:
        index.apply("n1", [ChunkOp(EventKind.STORED, Tier.CPU, ns_id, keys)])
    config = RouterConfig(
        policy="round-robin",
        backends=[BackendConfig(url=f"http://{n}.invalid:8000", name=n) for n in ("i0", "i1")],
    )
    backends = Backends(config, index)
    backends.refresh()
    return RoutingCore(backends, make_policy("round-robin"), index)


@pytest.mark.parametrize(("held", "word"), [(0, 0), (2, 2 * CHUNK), (4, None)])
def test_the_word_is_the_run_elsewhere_if_the_answer_bounds_it(held: int, word: int | None) -> None:
    """A run that ends before the prompt's last whole chunk is all another node holds; one
    that reaches it might go on past the keys asked about: no word then."""
    core = _core(held)
    words = {}
    for _ in range(2):  # round-robin: once to each
        routed = core.route(PROMPT, len(PROMPT), "s")
        words[routed.backend.name] = routed.elsewhere_tokens
    assert words["i0"] == word  # n1 is elsewhere for i0
    assert words["i1"] == 0  # n0 holds nothing
    # the proxy words only an instance that announced a connector reading the word
    readers = {b.name: b.reads_hint for b in core.backends.all()}
    assert readers == {"i0": True, "i1": False}


def test_no_index_no_word() -> None:
    config = RouterConfig(
        policy="round-robin", backends=[BackendConfig(url="http://a.invalid:8000", name="a")]
    )
    backends = Backends(config)
    backends.refresh()
    core = RoutingCore(backends, make_policy("round-robin"))
    assert core.route(PROMPT, len(PROMPT), "s").elsewhere_tokens is None


BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}


def test_the_word_is_appended_to_the_bytes_as_sent() -> None:
    raw = json.dumps(BODY).encode() + b"\n"
    sent = with_engine_hint(raw, BODY, 128)
    assert sent.startswith(raw.rstrip()[:-1])  # the client's bytes, untouched
    got = json.loads(sent)
    assert got == {**BODY, "kv_transfer_params": {"kvtier": {"elsewhere_tokens": 128}}}
    assert engine_hint.elsewhere_tokens(got["kv_transfer_params"]) == 128
    assert with_engine_hint(raw, BODY, None) is raw  # no word: the bytes as they came


def test_a_clients_own_params_are_kept_and_its_word_replaced() -> None:
    body = {**BODY, "kv_transfer_params": {"do_remote_prefill": True, "kvtier": {"x": 1}}}
    raw = json.dumps(body).encode()
    got = json.loads(with_engine_hint(raw, body, 64))
    assert got["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "kvtier": {"elsewhere_tokens": 64},
    }
    # no word of the router's: a client's word under the key is not passed on either
    got = json.loads(with_engine_hint(raw, body, None))
    assert got["kv_transfer_params"] == {"do_remote_prefill": True}
    null = {**BODY, "kv_transfer_params": None}  # a null field: replaced, not duplicated
    got = with_engine_hint(json.dumps(null).encode(), null, 64)
    assert got.count(b"kv_transfer_params") == 1
    assert json.loads(got)["kv_transfer_params"] == {"kvtier": {"elsewhere_tokens": 64}}
    plain = {**BODY, "kv_transfer_params": {"do_remote_prefill": True}}
    raw = json.dumps(plain).encode()
    assert with_engine_hint(raw, plain, None) is raw


@pytest.mark.parametrize(
    "params",
    [None, [], {"kvtier": 5}, {"kvtier": {"elsewhere_tokens": -1}},
     {"kvtier": {"elsewhere_tokens": True}}, {"kvtier": {"elsewhere_tokens": "64"}}, {}],
)  # fmt: skip
def test_a_malformed_word_is_no_word(params: object) -> None:
    assert engine_hint.elsewhere_tokens(params) is None
