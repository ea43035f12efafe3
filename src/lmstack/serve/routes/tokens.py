"""``POST /tokenize`` (a text prompt, or chat messages rendered with the model's template) and
``POST /detokenize``. Tokenising a large body takes seconds: it never runs on the event loop."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from lmstack.serve.protocol import DetokenizeRequest, TokenizeRequest
from lmstack.serve.server import APIError, ServerDep

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, server: ServerDep):
    server.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt (text) or messages (chat)", param="prompt")
    if body.messages is not None:
        ids = await run_in_threadpool(server.chat_ids, body.messages, body.add_generation_prompt)
    else:
        ids = await run_in_threadpool(server.tokenizer.encode, body.prompt)
    return {"tokens": ids, "count": len(ids), "max_model_len": server.engine.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, server: ServerDep):
    server.check_model(body.model)
    V = server.tokenizer.vocab_size
    bad = [t for t in body.tokens if t >= V]
    if bad:
        raise APIError(
            400,
            f"tokens {bad[:5]} are outside the tokenizer's vocabulary [0, {V})",
            param="tokens",
        )
    return {"prompt": await run_in_threadpool(server.tokenizer.decode, body.tokens)}
