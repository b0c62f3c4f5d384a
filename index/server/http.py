"""The index over HTTP (FastAPI), for probes, Prometheus, people and scripts.

Open: ``/healthz``, ``/readyz``, and ``/metrics`` unless ``auth.metrics_public`` is false.
Everything else needs a credential when auth is configured (docs/security.md): ``/stats``,
``/locations`` and ``/query`` a reader's, ``/namespaces`` (every tenant's) a router's (reader)
or an admin's, never an engine's. A caller limited to tenants sees only its tenants'
namespaces, everywhere (``IndexAccess``).

- ``GET /healthz``: the process answers (liveness).
- ``GET /readyz``: 200 when the backend answers and no followed source is blinded; 503
  ``degraded`` with the reason otherwise.
- ``GET /metrics``: Prometheus text format.
- ``GET /stats``: backend figures, locations, and every followed source, as JSON.
- ``GET /locations``, ``GET /namespaces``.
- ``POST /query`` (body at most 1 MiB): ``{"ns": "<32 hex>", "tokens": [...]}`` or
  ``{"ns": ..., "keys": ["<32 hex>", ...]}``, or ``{"queries": [<those>, ...]}``; answers what
  every location holds.

Errors answer ``{"code": "<ErrorCode>", "message": ...}`` with 400/404/503.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Body, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError

from kvtier import __version__
from kvtier.core.auth import Permission, Principal
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.http import HttpGuard
from kvtier.core.keys import keys_from_hex
from kvtier.index.api import IndexHealth, LocationInfo, Query, QueryResult
from kvtier.index.server.access import IndexAccess

_HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.UNKNOWN_NAMESPACE: 404,
    ErrorCode.UNKNOWN_LOCATION: 404,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.LIMIT_EXCEEDED: 429,
    ErrorCode.UNAVAILABLE: 503,
}


class PromptBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ns: str
    tokens: list[int] | None = None
    keys: list[str] | None = None

    def query(self) -> Query:
        try:
            ns_id = bytes.fromhex(self.ns)
            keys = keys_from_hex(self.keys) if self.keys is not None else None
        except ValueError as exc:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"bad hex: {exc}") from None
        if len(ns_id) != 16:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "ns is 32 hex digits")
        return Query(ns_id, keys=keys, tokens=self.tokens)


class BatchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    queries: list[PromptBody]


def result_json(result: QueryResult) -> dict[str, Any]:
    return {
        "ns": result.ns_id.hex(),
        "num_chunks": result.num_chunks,
        "health": result.health.value,
        "holdings": [
            {
                "location": h.location,
                "kind": h.kind.value,
                "node": h.node,
                "runs": {t.value: n for t, n in h.runs.items()},
                "total": h.total,
                "last_seen": h.last_seen,
                "stored_at": h.stored_at,
            }
            for h in result.holdings
        ],
    }


def location_json(info: LocationInfo) -> dict[str, Any]:
    reg = info.registration
    return {
        "location": reg.location,
        "kind": reg.kind.value,
        "node": reg.node,
        "namespaces": [ns.hex() for ns in reg.namespaces],
        "endpoints": dict(reg.endpoints),
        "status": info.status.value,
        "last_seen": info.last_seen,
        "cursor": {"epoch": info.cursor.epoch, "seq": info.cursor.seq},
        "entries": {t.value: n for t, n in info.entries.items()},
    }


def _error(exc: KvtierError) -> JSONResponse:
    return JSONResponse(
        {"code": exc.code.value, "message": exc.message},
        status_code=_HTTP_STATUS.get(exc.code, 500),
    )


def build_app(
    access: IndexAccess,
    registry: CollectorRegistry,
    stats: Callable[[], dict[str, Any]],
    started: Callable[[], bool],
    guard: HttpGuard,
    metrics_public: bool = True,
) -> FastAPI:
    app = FastAPI(title="kvtier index", version=__version__)
    index = access.index
    querier = guard.require(Permission.INDEX_QUERY)  # the caller, a Principal
    lister = guard.require(Permission.INDEX_LIST)
    metrics_deps = [] if metrics_public else [guard.require(Permission.METRICS)]

    @app.exception_handler(KvtierError)
    async def kvtier_error(request: Request, exc: KvtierError) -> JSONResponse:
        return _error(exc)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> Response:
        if not started():
            return JSONResponse({"status": "starting"}, status_code=503)
        health, reason = index.health()
        if health is IndexHealth.DEGRADED:
            return JSONResponse({"status": "degraded", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ready", "backend": reason})

    @app.get("/metrics", dependencies=metrics_deps)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    def get_stats(principal: Principal = querier) -> dict[str, Any]:
        return access.stats(principal, stats())

    @app.get("/locations")
    def locations(principal: Principal = querier) -> list[dict[str, Any]]:
        return [location_json(i) for i in access.locations(principal)]

    @app.get("/namespaces")
    def namespaces(principal: Principal = lister) -> dict[str, Any]:
        return {
            ns.hex(): (d.model_dump() if d is not None else None)
            for ns, d in access.namespaces(principal).items()
        }

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(KvtierError(ErrorCode.INVALID_ARGUMENT, f"bad request: {exc.errors()}"))

    @app.post("/query")
    def query(body: Any = Body(...), principal: Principal = querier) -> Response:  # noqa: B008
        # a sync handler: FastAPI runs it on its thread pool, off the event loop
        try:
            if isinstance(body, dict) and "queries" in body:
                prompts = BatchBody.model_validate(body).queries
                batch = True
            else:
                prompts = [PromptBody.model_validate(body)]
                batch = False
        except (ValueError, ValidationError) as exc:
            return _error(KvtierError(ErrorCode.INVALID_ARGUMENT, f"bad query: {exc}"))
        try:
            results = access.query(principal, [p.query() for p in prompts])
        except KvtierError as exc:
            return _error(exc)
        answers = [result_json(r) for r in results]
        return JSONResponse({"answers": answers} if batch else answers[0])

    return app
