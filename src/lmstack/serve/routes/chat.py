"""``POST /v1/chat/completions``: the messages through the model's chat template, ``n`` choices (choice i
samples with ``seed + i``), logprobs, ``response_format`` (grammar-constrained JSON), tool calls
(``tools.py``), SSE streaming."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from lmstack.inference.engine import GenerationError
from lmstack.serve import tools
from lmstack.serve.protocol import ChatCompletionRequest
from lmstack.serve.responses import chat_logprobs, finish_reason, usage
from lmstack.serve.server import APIError, ServerDep, engine_error
from lmstack.serve.streaming import chat_stream, collect, streaming_response, until_disconnect

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, server: ServerDep):
    server.check_model(body.model)
    server.check_n(body.n)
    server.unsupported(body)
    plan = tools.plan(body, server.tokenizer.chat_template)
    rendered = plan.tools if plan is not None and plan.render else None
    ids = await run_in_threadpool(server.chat_ids, body.messages, True, rendered)  # off the loop
    asked = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    max_tokens = server.max_tokens(ids, asked)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    processors = server.structured(body, plan)
    params = [
        server.sampling(body, max_tokens, logprobs, i, processors[i] if processors else ())
        for i in range(body.n)
    ]
    server.precheck(ids, params[0])
    lease = await server.admit(body.n)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gens = [server.run(ids, p, f"{rid}-{i}") for i, p in enumerate(params)]
    outputs = [tools.ToolOutput(plan) for _ in params] if plan is not None else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return streaming_response(
            lease,
            chat_stream(server, gens, rid, created, len(ids), include_usage, logprobs, outputs),
        )
    try:
        outs = await until_disconnect(request, collect(gens))
    except GenerationError as e:
        raise engine_error(e) from None
    finally:
        lease.release()
    choices = []
    for i, out in enumerate(outs):
        lp = None
        if logprobs is not None:
            lp = chat_logprobs(server, zip(out.token_ids, out.logprobs))
        to = outputs[i] if outputs is not None else None
        message = (
            to.message(out.text)
            if to is not None
            else {"role": "assistant", "content": out.text, "refusal": None}
        )
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": lp,
                "finish_reason": finish_reason(out, to),
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": server.model_name,
        "system_fingerprint": None,
        "choices": choices,
        "usage": usage(len(ids), sum(len(o.token_ids) for o in outs)),
    }
