"""ASGI guards in front of every route: the API key (``Authorization: Bearer KEY``) and the request-body
limit (413). Plain ASGI middlewares: Starlette's ``BaseHTTPMiddleware`` would hide client disconnects
from the routes."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmstack.serve.protocol import error_body
from lmstack.serve.server import Server

#: routes that answer without the API key: liveness, the chat page (it asks for the key itself), and /metrics
#: when the server is started with ``public_metrics`` (a Prometheus scraper without the key)
PUBLIC_ROUTES = ("/health", "/")


def protected(path: str, public_metrics: bool) -> bool:
    """With an API key every route needs it — /v1/*, /tokenize, /detokenize, /docs, /openapi.json, /metrics and
    any route added later — except ``PUBLIC_ROUTES`` (and /metrics with ``public_metrics``)."""
    if path in PUBLIC_ROUTES:
        return False
    return not (public_metrics and path == "/metrics")


class BodyLimit:
    """Request bodies above ``server.max_body_bytes`` get a 413 before the route reads them (a declared
    Content-Length), or as soon as a streamed body passes the limit: one client's huge body cannot hold the
    event loop or the memory."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.server.max_body_bytes
        too_large = JSONResponse(
            error_body(
                f"the request body is larger than this server accepts ({limit} bytes)",
                code="request_too_large",
            ),
            status_code=413,
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await too_large(scope, receive, send)
        seen = 0

        async def counted():  # a body without Content-Length (chunked): stop reading it at the limit
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if (
                    seen > limit
                ):  # FastAPI passes an HTTPException through its body parsing: a 413 error object
                    raise StarletteHTTPException(
                        413, f"the request body is larger than this server accepts ({limit} bytes)"
                    )
            return message

        await self.app(scope, counted, send)


class BearerAuth:
    """``Authorization: Bearer KEY`` on every route but ``PUBLIC_ROUTES`` when the server has a key (``protected``);
    a missing or wrong key is a 401 before the body is read."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        key = self.server.api_key
        path = scope.get("path", "")
        if key and scope["type"] == "http" and protected(path, self.server.public_metrics):
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {key}":
                response = JSONResponse(
                    error_body(
                        "invalid or missing API key (Authorization: Bearer KEY)",
                        code="invalid_api_key",
                    ),
                    status_code=401,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
