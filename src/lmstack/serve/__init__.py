"""Serving: an OpenAI-compatible HTTP server over the continuous-batching engine (``lmstack serve``).

``build_app(Server(engine, name))`` is the FastAPI app (``app.py`` assembles ``server.py``, the state;
``streaming.py``; ``routes/``, one router per job); ``cli.py`` loads a model and runs it
under uvicorn. docs/serving.md says how to run it and what was measured.

FastAPI, uvicorn and prometheus-client are the ``serve`` extra (``pip install 'lmstack[serve]'``):
``lmstack.serve.cli`` registers the command without them, and the first use of ``Server`` /
``build_app`` / ``APIError`` says which extra is missing.
"""

from lmstack.utils import import_extra

__all__ = ["APIError", "Server", "build_app", "require_serve"]


def require_serve() -> None:
    """Raise a ``ModuleNotFoundError`` naming the ``serve`` extra unless its packages import."""
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        import_extra(module, "serve", "lmstack serve")


def __getattr__(name: str):
    if name not in ("APIError", "Server", "build_app"):
        raise AttributeError(f"module 'lmstack.serve' has no attribute {name!r}")
    require_serve()
    from lmstack.serve.app import build_app
    from lmstack.serve.server import APIError, Server

    return {"APIError": APIError, "Server": Server, "build_app": build_app}[name]
