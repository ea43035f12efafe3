"""The recipe "add a server route" (docs/architecture.md) done from outside the package: a toy ``APIRouter``
added to ``routes.ROUTERS`` is served by ``build_app``, needs the API key like every route but the public ones,
and answers its errors (its own ``APIError``, a bad body) as OpenAI error objects. The route-table × key test
of ``test_serve_errors.py`` then covers it too, unchanged."""

import httpx
import pytest
import test_serve_errors
from fastapi import APIRouter
from pydantic import BaseModel
from serve_helpers import MODEL, live_server, route_table, tiny_engine

from lmstack.serve import Server, build_app, routes
from lmstack.serve.server import APIError, ServerDep

toy = APIRouter()


class Double(BaseModel):
    n: int


@toy.post("/v1/toy/double")
async def double(body: Double, server: ServerDep):
    if body.n < 0:
        raise APIError(400, f"n={body.n}; expected n >= 0", param="n", code="invalid_value")
    return {"object": "toy", "model": server.model_name, "twice": 2 * body.n}


@pytest.fixture
def with_toy(monkeypatch):
    monkeypatch.setattr(routes, "ROUTERS", (*routes.ROUTERS, toy))


def _is_error_object(body, message, param, code):
    """OpenAI's shape: {"error": {"message", "type", "param", "code"}}, written out by hand."""
    e = body["error"]
    assert set(e) == {"message", "type", "param", "code"}
    assert message in e["message"] and e["param"] == param and e["code"] == code
    assert e["type"] == "invalid_request_error"


def test_a_toy_router_is_served_behind_the_key_with_openai_errors(with_toy):
    server = Server(tiny_engine(), MODEL, api_key="sekret")
    assert ("POST", "/v1/toy/double") in route_table(build_app(server))
    key = {"Authorization": "Bearer sekret"}
    with live_server(server) as url:
        r = httpx.post(url + "/v1/toy/double", json={"n": 21}, headers=key)
        assert r.status_code == 200 and r.json() == {"object": "toy", "model": MODEL, "twice": 42}
        r = httpx.post(url + "/v1/toy/double", json={"n": 21})
        assert r.status_code == 401
        _is_error_object(r.json(), "API key", None, "invalid_api_key")
        r = httpx.post(url + "/v1/toy/double", json={"n": -1}, headers=key)
        assert r.status_code == 400
        _is_error_object(r.json(), "n=-1; expected n >= 0", "n", "invalid_value")
        r = httpx.post(url + "/v1/toy/double", json={"n": "many"}, headers=key)
        assert r.status_code == 400
        _is_error_object(r.json(), "n:", "n", "invalid_value")


def test_the_route_table_key_test_covers_the_toy_route(with_toy):
    # the existing test walks build_app's route table: with the toy router listed it sends the toy route a
    # missing and a wrong key too (and would fail if the route answered without one)
    test_serve_errors.test_with_a_key_every_route_but_health_and_the_chat_page_needs_it()
