"""Health, readiness, metrics and stats over HTTP (FastAPI), for probes, Prometheus and people.

- ``/healthz``: the process answers (liveness).
- ``/readyz``: the pool is mapped and the control API is serving (readiness); 503 otherwise.
- ``/metrics``: Prometheus text format.
- ``/stats``: the store's stats as JSON.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvtier import __version__
from kvtier.store.api import StoreClient


def build_app(
    store: StoreClient, registry: CollectorRegistry, ready: Callable[[], bool]
) -> FastAPI:
    app = FastAPI(title="kvtier store", version=__version__)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> Response:
        if not ready():
            return JSONResponse({"status": "not ready"}, status_code=503)
        info = store.info()
        return JSONResponse({"status": "ready", "node_id": info.node_id, "epoch": info.epoch})

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    def stats() -> dict[str, int | float | str]:
        return store.stats()

    return app


class HttpServer:
    """uvicorn in a background thread, stoppable."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="kvtier-http", daemon=True)

    def start(self, timeout: float = 10.0) -> int:
        """Start serving; returns the bound port."""
        self._thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout / 0.01)):
            if self._server.started:
                break
            if not self._thread.is_alive():
                raise RuntimeError("HTTP server failed to start (port in use?)")
            deadline.wait(0.01)
        else:
            raise RuntimeError("HTTP server did not start in time")
        return self._server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
