"""A stand-in for a vLLM instance's OpenAI API, served over a real socket, whose behaviour a
test sets: answer, stream, fail with 503, hang, break mid-stream. Only for the faults a real
engine cannot be made to produce on demand; tests/engine/test_router_vllm.py uses real vLLM.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from kvtier.core.http import BODY_LIMIT, HttpServer

STREAM_CHUNKS = [
    b'data: {"choices": [{"text": "a"}]}\n\n',
    b'data: {"choices": [{"text": "b"}]}\n\n',
    b'data: {"choices": [{"text": "c"}], "usage": {"prompt_tokens": 8, '
    b'"prompt_tokens_details": {"cached_tokens": 4}}}\n\n',
    b"data: [DONE]\n\n",
]


@dataclass
class StubState:
    mode: str = "ok"  # ok | 503 | hang | break | slow-stream
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    probes: int = 0
    probe_times: list[float] = field(default_factory=list)  # time.monotonic() of each
    probe_hang: bool = False  # a probe is never answered (the router's probe times out)
    metrics_hang: bool = False  # /metrics answers nothing (the router's scrape times out)
    metrics_gets: list[float] = field(default_factory=list)  # time.monotonic() of each


def stub_app(name: str, state: StubState) -> FastAPI:
    app = FastAPI()

    async def answer(request: Request) -> Response:
        body = await request.json()
        if body.get("max_tokens") == 1 and body.get("prompt") == [1]:
            state.probes += 1
            state.probe_times.append(time.monotonic())
            if state.probe_hang:
                await asyncio.sleep(60)
            if state.mode in ("503", "hang"):
                return JSONResponse({"error": "down"}, status_code=503)
            return JSONResponse({"choices": [{"text": "x"}]})
        state.received.append(body)
        state.headers.append(dict(request.headers))
        if state.mode == "503":
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        if state.mode == "hang":
            await asyncio.sleep(3600)
        if body.get("stream"):
            return StreamingResponse(stream(), media_type="text/event-stream")
        return JSONResponse(
            {
                "served_by": name,
                "choices": [{"text": "ok"}],
                "usage": {"prompt_tokens": 8, "prompt_tokens_details": {"cached_tokens": 4}},
            }
        )

    async def stream() -> AsyncIterator[bytes]:
        try:
            for i, chunk in enumerate(STREAM_CHUNKS):
                if state.mode == "break" and i == 2:
                    # right behind the bytes sent: the router may receive both in one read
                    raise RuntimeError("engine died mid-stream")  # uvicorn drops the connection
                yield chunk
                if state.mode == "slow-stream":
                    await asyncio.sleep(30)
        except asyncio.CancelledError:
            state.cancelled.set()
            raise

    app.post("/v1/completions")(answer)
    app.post("/v1/chat/completions")(answer)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"data": [{"id": "stub"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await request.json()
        text = body.get("prompt") or json.dumps(body.get("messages"))
        return {"tokens": [ord(c) % 500 for c in text]}

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics_gets.append(time.monotonic())
        if state.metrics_hang:
            await asyncio.sleep(60)
        text = f"vllm:num_requests_running {len(state.received)}\nvllm:num_requests_waiting 0\n"
        return Response(text, media_type="text/plain")

    return app


class StubBackend:
    def __init__(self, name: str, body_limit: int = BODY_LIMIT) -> None:
        """``body_limit``: the largest request body it takes (vLLM's is far larger)."""
        self.name = name
        self.state = StubState()
        self._server = HttpServer(stub_app(name, self.state), "127.0.0.1", 0, body_limit=body_limit)
        self.port = self._server.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop()
