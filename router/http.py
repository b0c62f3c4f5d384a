"""The router's HTTP routes: the OpenAI-compatible front door (``proxy.py``) and its health,
readiness and metrics pages (as ``store/server/http.py`` and ``index/server/http.py`` are the
services')."""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier import __version__
from kvtier.router.backends import NoBackend
from kvtier.router.proxy import Proxy


def build_app(proxy: Proxy) -> FastAPI:
    app = FastAPI(title="kvtier router", version=__version__)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return proxy.refused(request) or await proxy.models()

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> Response:
        # A degraded index leaves the router ready: it still routes (by load). 503 would take
        # every replica out of its load balancer at once for an index fault: an outage.
        index = proxy.core.index_state()
        try:
            n = len(proxy.backends.routable())
        except NoBackend as exc:
            body = {"status": "not ready", "reason": str(exc), **index}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ready", "backends": n, **index})

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
