"""``GET /health`` (liveness; public), ``GET /metrics`` (Prometheus text) and ``GET /v1/models``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from lmstack.serve.server import APIError, ServerDep

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(server: ServerDep):
    if not server.llm.alive:
        raise APIError(
            503, "the engine loop died (it restarts with the next request)", "server_error"
        )
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(server: ServerDep):
    return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(server: ServerDep):
    return {
        "object": "list",
        "data": [
            {
                "id": server.model_name,
                "object": "model",
                "created": server.created,
                "owned_by": "lmstack",
                "max_model_len": server.engine.max_model_len,
            }
        ],
    }
