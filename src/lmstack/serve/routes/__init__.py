"""The HTTP routes, one ``APIRouter`` per job; ``app.build_app`` includes every router in ``ROUTERS``.

Adding a route: a router in a module here (its handlers take the ``Server`` through the ``ServerDep``
dependency, raise ``APIError`` for OpenAI error objects), listed in ``ROUTERS``; ``build_app`` reads ``ROUTERS``
when it builds the app. With an API key the new route needs it too (``guards.protected``: every route but
``PUBLIC_ROUTES``). ``tests/serve/test_serve_recipe_route.py`` adds a toy router this way.
"""

from lmstack.serve.routes import chat, completions, info, page, tokens

ROUTERS = (info.router, page.router, tokens.router, chat.router, completions.router)

__all__ = ["ROUTERS"]
