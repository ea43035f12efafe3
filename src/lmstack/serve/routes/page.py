"""``GET /``: the chat page (``static/index.html``: plain HTML/CSS/JS, it asks for the API key itself)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()
STATIC = Path(__file__).parent.parent / "static"


@router.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)
async def chat_page():
    return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))
