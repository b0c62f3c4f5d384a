"""The router's HTTP clients to its instances: one connection pool per instance.

Why not one ``httpx.AsyncClient`` for all: httpcore's pool walks every connection it holds
on each request it sends and on each response it closes (``has_expired`` / ``is_idle``
per connection, a socket check each). With one pool for every instance a request cost
O(all instances' connections): a third of the router's CPU at 16 instances
(``kvtier bench router-scrape``, docs/router.md), and growing with the fleet. A pool per
instance walks that instance's few connections.

Two clients per instance: clients' requests are forwarded with aiohttp (``forwarder``), the
router's own calls (health probes, ``/metrics`` scrapes, ``/tokenize``, offloaded prefills)
use httpx (``to``). Why two: on the request path httpx (with anyio under it) was half of the
router's CPU per request (py-spy, ``--gil``: 1.6 of 3.1 ms on this host), and forwarding with
aiohttp took the router's CPU per request down by a quarter (``kvtier bench router-scrape``,
docs/benchmarks.md); the background calls are a few a second, where the cost does not
matter and httpx's timeouts and API read better.

A pool whose instance has left the router's table is closed once it has been unused for
``IDLE_CLOSE_S`` (long past any request's deadline), so a fleet whose instances come and go
does not accumulate them.

Threading: used from the router's event loop only.
"""

from __future__ import annotations

import time

import aiohttp
import httpx

IDLE_CLOSE_S = 600.0


class UpstreamClients:
    def __init__(self, limits: httpx.Limits, timeout: httpx.Timeout) -> None:
        """``timeout``'s connect and read deadlines hold for both clients (read: the wait
        for each read, the first byte of a non-streamed answer included)."""
        self.limits = limits
        self.timeout = timeout
        self.forward_timeout = aiohttp.ClientTimeout(
            total=None, connect=timeout.connect, sock_read=timeout.read
        )
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._used: dict[str, float] = {}  # base URL -> time.monotonic() of its last use

    def to(self, url: str) -> httpx.AsyncClient:
        """The pool for the instance at base URL ``url``."""
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = httpx.AsyncClient(
                limits=self.limits, timeout=self.timeout
            )
        self._used[url] = time.monotonic()
        return client

    def forwarder(self, url: str) -> aiohttp.ClientSession:
        """The session that forwards clients' requests to the instance at ``url``: aiohttp,
        not httpx, on the request path (module docstring). Asks for no compression: the
        answer is relayed as it comes."""
        session = self._sessions.get(url)
        if session is None or session.closed:
            session = self._sessions[url] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),  # the router caps in-flight itself
                timeout=self.forward_timeout,
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
                trust_env=True,  # HTTP(S)_PROXY / NO_PROXY as the httpx clients read them
            )
        self._used[url] = time.monotonic()
        return session

    def __len__(self) -> int:
        return len(self._used)

    async def close_unused(self, known: set[str], now: float | None = None) -> int:
        """Close the pools of instances not in ``known`` unused for ``IDLE_CLOSE_S``;
        returns how many."""
        now = time.monotonic() if now is None else now
        gone = [
            url
            for url, used in self._used.items()
            if url not in known and now - used > IDLE_CLOSE_S
        ]
        for url in gone:
            del self._used[url]
            await self._close(url)
        return len(gone)

    async def _close(self, url: str) -> None:
        client, session = self._clients.pop(url, None), self._sessions.pop(url, None)
        if client is not None:
            await client.aclose()
        if session is not None:
            await session.close()

    async def aclose(self) -> None:
        urls = set(self._clients) | set(self._sessions)
        self._used = {}
        for url in urls:
            await self._close(url)
