"""Serving: an OpenAI-compatible HTTP server over the continuous-batching engine (``lmstack serve``).

``build_app(Server(engine, name))`` is the FastAPI app (``app.py`` assembles ``server.py``, the state;
``streaming.py``; ``routes/``, one router per job); ``cli.py`` loads a model and runs it
under uvicorn. docs/serving.md says how to run it and what was measured.
"""

from lmstack.serve.app import build_app
from lmstack.serve.server import APIError, Server

__all__ = ["APIError", "Server", "build_app"]
