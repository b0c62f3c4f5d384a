"""What the router tells the instance it routed a request to, inside the request itself.

The router asked the index about the prompt to choose the instance; the instance's connector
would ask again (its remote tier: does another node hold a longer run than this node's
pool?) before the request may be scheduled. On a busy machine that second query takes longer
than the few ms a step waits for a lookup, and every such request then waits a whole step or
more ("ask again") before it computes anything: measured in ``kvtier bench cluster`` as
kvtier's misses taking 20-50 % longer per token than vLLM's alone under the same
round-robin routing (docs/benchmarks-cluster.md, run 11).

So the router hands its answer on: the longest DRAM run of the prompt on a node other than
the chosen instance's, in tokens, in the request's ``kv_transfer_params`` (vLLM passes them
to the connector with the request). The connector skips its own index query when that run
could not extend what its node holds by a worthwhile hit (``min_hit_tokens["remote"]``).

It is a hint, never a source of bytes: a word that says less than the index would (a run
stored after the decision, or one the router's index replica had not seen yet) costs a
remote hit, which the request recomputes; a word that says more only makes the connector
ask the index as it would anyway. A client that writes the word itself affects its own
request alone; the router replaces whatever a client sent under this key.
"""

from __future__ import annotations

from typing import Any

# kv_transfer_params[PARAM] = {"elsewhere_tokens": int}
PARAM = "kvtier"
ELSEWHERE = "elsewhere_tokens"
# An instance whose connector reads the word says so when it announces itself to the index
# (``Registration.endpoints[READER_ENDPOINT] == READER``); the router words no other instance
# (vLLM warns on every request that carries kv_transfer_params to an engine without a
# connector).
READER_ENDPOINT = "connector"
READER = "kvtier"


def hint(elsewhere_tokens: int) -> dict[str, int]:
    """The router's word for one request: the best run of its prompt on another node."""
    return {ELSEWHERE: max(0, int(elsewhere_tokens))}


def elsewhere_tokens(kv_transfer_params: Any) -> int | None:
    """The router's word in a request's ``kv_transfer_params``, or None: absent or malformed
    (then the connector asks the index itself)."""
    if not isinstance(kv_transfer_params, dict):
        return None
    word = kv_transfer_params.get(PARAM)
    if not isinstance(word, dict):
        return None
    tokens = word.get(ELSEWHERE)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        return None
    return tokens
