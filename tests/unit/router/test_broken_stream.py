"""What the proxy forwards when an engine's stream breaks with bytes still buffered.

aiohttp's reader raises a broken transfer before the data it buffered with it; the proxy
takes that data first (``router.responses._still_buffered``), so a client gets every token the
engine sent before the error event. Checked on aiohttp's real ``StreamReader``, fed as its
connection would feed it (the race needs a slow reader on a loaded host to happen over a
socket: tests/integration/test_router_proxy.py covers the socket path).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from unittest import mock

import aiohttp
import pytest
from aiohttp.streams import StreamReader

from kvtier.router.responses import _still_buffered


def broken_after(loop: asyncio.AbstractEventLoop, *chunks: bytes) -> StreamReader:
    reader = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=loop)
    for chunk in chunks:
        reader.feed_data(chunk)
    reader.set_exception(aiohttp.ClientPayloadError("Response payload is not completed"))
    return reader


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_aiohttp_raises_before_its_buffered_bytes(loop: asyncio.AbstractEventLoop) -> None:
    # the premise: without the proxy's drain these bytes never reach the client
    reader = broken_after(loop, b"data: 1\n\n")
    with pytest.raises(aiohttp.ClientPayloadError):
        loop.run_until_complete(reader.readany())


def test_the_bytes_sent_before_the_break_are_taken_once(loop: asyncio.AbstractEventLoop) -> None:
    reader = broken_after(loop, b"data: 1\n\n", b"data: 2\n\n")
    assert _still_buffered(reader) == b"data: 1\n\ndata: 2\n\n"
    assert _still_buffered(reader) == b""


def test_a_break_with_nothing_buffered_gives_nothing(loop: asyncio.AbstractEventLoop) -> None:
    assert _still_buffered(broken_after(loop)) == b""
