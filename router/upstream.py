"""The router's HTTP clients to its instances: one connection pool per instance.

Why not one ``httpx.AsyncClient`` for all: httpcore's pool walks every connection it holds
on each request it sends and on each response it closes (``has_expired`` / ``is_idle``
per connection, a socket check each). With one pool for every instance a request cost
O(all instances' connections): a third of the router's CPU at 16 instances
(``kvtier bench router-scrape``, docs/router.md), and growing with the fleet. A pool per
instance walks that instance's few connections.

A pool whose instance has left the router's table is closed once it has been unused for
``IDLE_CLOSE_S`` (long past any request's deadline), so a fleet whose instances come and go
does not accumulate them.

Threading: used from the router's event loop only.
"""

from __future__ import annotations

import time

import httpx

IDLE_CLOSE_S = 600.0


class UpstreamClients:
    def __init__(self, limits: httpx.Limits, timeout: httpx.Timeout) -> None:
        self.limits = limits
        self.timeout = timeout
        self._clients: dict[str, httpx.AsyncClient] = {}
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

    def __len__(self) -> int:
        return len(self._clients)

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
            await self._clients.pop(url).aclose()
        return len(gone)

    async def aclose(self) -> None:
        clients, self._clients, self._used = self._clients, {}, {}
        for client in clients.values():
            await client.aclose()
