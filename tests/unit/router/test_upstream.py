"""The router's per-instance connection pools (``router/upstream.py``): one per instance,
reused, and closed only once its instance has left the table and gone unused for long."""

from __future__ import annotations

import asyncio
import time

import httpx

from kvtier.router.upstream import IDLE_CLOSE_S, UpstreamClients


def test_one_pool_per_instance_closed_once_gone_and_unused() -> None:
    async def scenario() -> None:
        upstream = UpstreamClients(httpx.Limits(), httpx.Timeout(5.0))
        a, b = upstream.to("http://a:1"), upstream.to("http://b:1")
        assert a is not b and upstream.to("http://a:1") is a and len(upstream) == 2
        # b left the table: kept while it may still serve a request that began before
        assert await upstream.close_unused({"http://a:1"}) == 0
        later = time.monotonic() + IDLE_CLOSE_S + 1
        # a is still known: kept however long unused; b is gone and long unused: closed
        assert await upstream.close_unused({"http://a:1"}, now=later) == 1
        assert b.is_closed and not a.is_closed and len(upstream) == 1
        assert upstream.to("http://b:1") is not b  # it came back: a new pool
        await upstream.aclose()
        assert a.is_closed and len(upstream) == 0

    asyncio.run(scenario())


def test_forwarding_sessions_share_the_pools_lifecycle() -> None:
    async def scenario() -> None:
        upstream = UpstreamClients(httpx.Limits(), httpx.Timeout(5.0, read=7.0))
        a = upstream.forwarder("http://a:1")
        assert upstream.forwarder("http://a:1") is a and len(upstream) == 1
        # the instance's deadlines: connecting, and the wait for each read (first byte)
        assert (a.timeout.connect, a.timeout.sock_read, a.timeout.total) == (5.0, 7.0, None)
        probe = upstream.to("http://a:1")  # the same instance: one entry, both clients
        assert len(upstream) == 1
        later = time.monotonic() + IDLE_CLOSE_S + 1
        assert await upstream.close_unused(set(), now=later) == 1
        assert a.closed and probe.is_closed and len(upstream) == 0
        b = upstream.forwarder("http://a:1")
        assert b is not a and not b.closed  # it came back: a new session
        await upstream.aclose()
        assert b.closed

    asyncio.run(scenario())
