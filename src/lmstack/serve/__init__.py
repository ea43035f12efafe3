"""Serving: an OpenAI-compatible HTTP server over the continuous-batching engine (``lmstack serve``).

``app.build_app(Server(engine, name))`` is the FastAPI app; ``cli.py`` loads a model and runs it
under uvicorn. docs/serving.md says how to run it and what was measured.
"""

from lmstack.serve.app import APIError, Server, build_app

__all__ = ["APIError", "Server", "build_app"]
