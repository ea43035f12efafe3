"""The HTTP routes, one ``APIRouter`` per job; ``app.build_app`` includes every router in ``ROUTERS``.

Adding a route: a router in a module here (its handlers take the ``Server`` through the ``ServerDep``
dependency), listed in ``ROUTERS``. With an API key the new route needs it too (``guards.protected``).
"""

from lmstack.serve.routes import chat, completions, info, page, tokens

ROUTERS = (info.router, page.router, tokens.router, chat.router, completions.router)

__all__ = ["ROUTERS"]
