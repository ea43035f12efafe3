"""The HTTP server under the app: uvicorn, with the shutdown drain and OpenAI error objects for requests
that never reach the app.

- **Shutdown** (SIGTERM / Ctrl-C): uvicorn stops accepting connections and waits for the open ones; beside
  it ``Server.drain`` refuses new requests (503) and gives those in flight ``shutdown_timeout`` seconds, then
  ends each one still running itself — a non-streamed request gets a 503 error object, a stream an error
  event and ``[DONE]`` — so uvicorn never has to cancel a request task (which would answer nothing, cut the
  stream and log a CancelledError traceback per request). uvicorn's own deadline is ``DRAIN_MARGIN`` s later.
- **Requests the HTTP parser refuses** (a malformed request line, headers larger than the parser buffers —
  h11 keeps 16 KiB — such as a 1 MB ``Authorization``) get OpenAI's error object as JSON (431 for too-large
  headers, else 400) instead of uvicorn's plain-text 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from http import HTTPStatus

from lmstack.serve.protocol import error_body
from lmstack.serve.server import Server

#: seconds uvicorn waits past the drain's deadline before it cancels what is left (answers are written then)
DRAIN_MARGIN = 5.0


def http_protocol():
    """uvicorn's HTTP protocol class (httptools if installed, else h11) answering parser errors as JSON."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class JSONErrorProtocol(AutoHTTPProtocol):
        def send_400_response(self, msg: str) -> None:  # called by uvicorn inside its ``except``
            exc = sys.exc_info()[1]
            status = getattr(exc, "error_status_hint", 400)
            if status == 431:
                message = (
                    "the request's headers are larger than this server reads; send a shorter "
                    "request head (an API key is a few dozen bytes)"
                )
                code = "request_header_fields_too_large"
            else:
                status = 400
                message = f"invalid HTTP request: {exc or msg}"
                code = "invalid_http_request"
            body = json.dumps(error_body(message, code=code)).encode()
            head = (
                f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
                "content-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head.encode("latin-1") + body)
            self.transport.close()

    return JSONErrorProtocol


def uvicorn_server(
    app, server: Server, host: str, port: int, shutdown_timeout: float, log_level: str = "info"
):
    """A ``uvicorn.Server`` for ``app`` (``build_app(server)``) whose shutdown drains ``server``."""
    import uvicorn

    class Draining(uvicorn.Server):
        async def shutdown(self, sockets=None):
            drain = asyncio.create_task(server.drain(shutdown_timeout))
            try:
                await super().shutdown(sockets)
            finally:
                drain.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drain

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=http_protocol(),
        timeout_graceful_shutdown=shutdown_timeout + DRAIN_MARGIN,
    )
    return Draining(config)
