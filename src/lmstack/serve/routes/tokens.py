"""``POST /tokenize`` (a text prompt, or chat messages rendered with the model's template) and
``POST /detokenize``. Tokenising a large body and writing its answer take seconds: neither runs on the
event loop (FastAPI's own encoding of a multi-million-id answer takes seconds; ``ids_json`` writes it in
slices, so the loop gets the GIL between them and ``/health`` keeps answering)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from lmstack.serve.protocol import DetokenizeRequest, TokenizeRequest
from lmstack.serve.responses import ids_json
from lmstack.serve.server import APIError, ServerDep

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, server: ServerDep):
    server.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt (text) or messages (chat)", param="prompt")

    def answer() -> Response:  # in a worker thread: the encoding and the (large) JSON answer
        if body.messages is not None:
            ids = server.chat_ids(body.messages, body.add_generation_prompt)
        else:
            ids = server.tokenizer.encode(body.prompt)
        n, m = len(ids), server.engine.max_model_len
        text = f'{{"tokens":{ids_json(ids)},"count":{n},"max_model_len":{m}}}'
        return Response(text, media_type="application/json")

    return await run_in_threadpool(answer)


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
