"""The OpenAI-compatible HTTP server: one engine loop (``AsyncLLM``) behind a FastAPI app.

Book of LLMs §2.1–2.2 (latency vs throughput; continuous batching), CS336 notes "推理" / "动态负载"
(requests arrive at any time with any length; iteration-level scheduling over a paged KV cache;
TTFT and per-token latency are what users see); DESIGN.md "Real parts" (FastAPI + uvicorn, the
OpenAI HTTP API). ``build_app`` assembles the parts, each in its own module:

- ``server.py``: ``Server``, the state (engine, tokenizer, limits and admission, the request checks);
- ``guards.py``: the API key and the body limit, in front of every route;
- ``streaming.py``: SSE chunks, the merge of ``n`` engine streams, disconnects;
- ``responses.py``: logprobs objects, finish reasons, usage;
- ``routes/``: one ``APIRouter`` per job (completions, chat, tokenize/detokenize, models/health/metrics,
  the chat page);
- ``http.py``: the uvicorn server under the app (the shutdown drain, JSON errors from the HTTP parser).

Here: the error handlers (every error is OpenAI's error object) and the lifespan (on shutdown every
request still in the engine is aborted, its blocks freed, and the loop stopped).
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmstack.serve import routes
from lmstack.serve.guards import BearerAuth, BodyLimit
from lmstack.serve.protocol import error_body
from lmstack.serve.server import APIError, Server

log = logging.getLogger("lmstack.serve")


def build_app(server: Server) -> FastAPI:
    """The FastAPI app over ``server``: its routers, guards and error handlers."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await server.llm.shutdown()  # every request still in the engine aborted, the loop stopped

    app = FastAPI(
        title="lmstack",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible API over lmstack's continuous-batching engine",
    )
    app.state.server = server
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(BodyLimit, server=server)
    app.add_middleware(BearerAuth, server=server)  # added last: runs first (no key, no body read)
    for router in routes.ROUTERS:  # read when the app is built: a router added to ROUTERS is served
        app.include_router(router)
    return app


async def _api_error(request: Request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status)


async def _validation_error(request: Request, e: RequestValidationError):
    errs = e.errors()
    # a union field reports one error per branch: the validator's own message (value_error) says most
    first = next((x for x in errs if x.get("type") == "value_error"), errs[0] if errs else {})
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        msg = f"the request body is not valid JSON: {first.get('msg')}"
    else:
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        if len(errs) > 1:
            msg += f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})"
    # a JSON error's loc is an offset into the body, not a field
    param = loc[0] if loc and first.get("type") != "json_invalid" else None
    return JSONResponse(error_body(msg, param=param, code="invalid_value"), status_code=400)


async def _http_error(request: Request, e: StarletteHTTPException):
    return JSONResponse(
        error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code
    )


async def _internal_error(request: Request, e: Exception):
    log.exception("unhandled error on %s", request.url.path)
    return JSONResponse(
        error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500
    )
