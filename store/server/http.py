"""Health, readiness, metrics and stats over HTTP (FastAPI), for probes, Prometheus and people.

- ``/healthz``: the process answers (liveness). Open.
- ``/readyz``: the pool is mapped and the control API is serving (readiness); 503 otherwise.
  Open (it says no more than ready or not).
- ``/metrics``: Prometheus text format; open unless ``auth.metrics_public`` is false.
- ``/stats``: the store's stats as JSON; needs a credential allowed to observe the store.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvtier import __version__
from kvtier.core.auth import Permission
from kvtier.core.http import HttpGuard
from kvtier.store.api import StoreAdmin


def build_app(
    store: StoreAdmin,
    registry: CollectorRegistry,
    ready: Callable[[], bool],
    guard: HttpGuard,
    metrics_public: bool = True,
) -> FastAPI:
    app = FastAPI(title="kvtier store", version=__version__)
    metrics_deps = [] if metrics_public else [guard.require(Permission.METRICS)]

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> Response:
        if not ready():
            return JSONResponse({"status": "not ready"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", dependencies=metrics_deps)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats", dependencies=[guard.require(Permission.STORE_OBSERVE)])
    def stats() -> dict[str, int | float | str]:
        return store.stats()

    return app
