"""``POST /v1/completions`` (OpenAI's legacy API): a prompt as a string, a list of strings, token ids or
lists of them; ``echo`` (with ``logprobs``: the prompt tokens' log-probabilities too, the first one
null, as vLLM and lm-eval's ``local-completions`` use it); ``max_tokens=0`` with ``echo`` scores the
prompt only; ``n`` choices per prompt; SSE streaming."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from lmstack.inference.engine import GenerationError
from lmstack.serve.protocol import CompletionRequest
from lmstack.serve.responses import completion_logprobs, finish_reason, usage
from lmstack.serve.server import APIError, ServerDep, engine_error
from lmstack.serve.streaming import collect, completion_stream, streaming_response, until_disconnect

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, server: ServerDep):
    server.check_model(body.model)
    server.check_n(body.n)
    server.unsupported(body)
    for field in ("tools", "tool_choice", "parallel_tool_calls"):
        if getattr(body, field) is not None:
            raise APIError(
                400, f"{field}: tool calls are for /v1/chat/completions (the chat API)", param=field
            )
    if body.suffix:
        raise APIError(
            400, "suffix is not supported (no fill-in-the-middle template)", param="suffix"
        )
    score_prompt = body.echo and body.logprobs is not None  # the prompt's own logprobs (prefill)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(
            400,
            "max_tokens=0 only makes sense with echo=true (score the prompt, generate nothing)",
            param="max_tokens",
        )
    if score_prompt and body.stream:
        raise APIError(400, "echo with logprobs is not supported with stream=true", param="stream")
    if body.max_tokens == 0 and body.stream:
        raise APIError(
            400,
            "max_tokens=0 (score the prompt only) is not supported with stream=true",
            param="stream",
        )
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt")
    if len(prompts) * body.n > server.max_n:
        raise APIError(
            400,
            f"{len(prompts)} prompts x n={body.n} is more than this server allows per request "
            f"({server.max_n})",
            param="n",
        )
    jobs = []  # (prompt ids, prompt text, params) per choice
    prompt_tokens = 0
    for j, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{j}]"
        ids = await run_in_threadpool(server.token_ids, p, param)  # CPU work off the event loop
        prompt_tokens += len(ids)
        # max_tokens=0 (echo only): the engine still runs one step, whose token is dropped
        max_tokens = server.max_tokens(
            ids, body.max_tokens or (None if body.max_tokens is None else 1)
        )
        text = p if isinstance(p, str) else server.tokenizer.decode(ids)
        for i in range(body.n):
            params = server.sampling(body, max_tokens, body.logprobs, i)
            if score_prompt:
                params.prompt_logprobs = body.logprobs
            if i == 0:
                server.precheck(ids, params)
            jobs.append((ids, text, params))
    lease = await server.admit(len(jobs))
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gens = [server.run(ids, params, f"{rid}-{k}") for k, (ids, _, params) in enumerate(jobs)]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return streaming_response(
            lease,
            completion_stream(
                server,
                gens,
                jobs,
                rid,
                created,
                prompt_tokens,
                include_usage,
                body.echo,
                body.logprobs,
            ),
        )
    try:
        outs = await until_disconnect(request, collect(gens))
    except GenerationError as e:
        raise engine_error(e) from None
    finally:
        lease.release()
    choices = []
    completion = 0
    for k, ((_, ptext, _), out) in enumerate(zip(jobs, outs)):
        gen_ids, gen_lps, gen_text = out.token_ids, out.logprobs, out.text
        if body.max_tokens == 0:  # echo only: the one token the engine made is not in the answer
            gen_ids, gen_lps, gen_text = [], [], ""
        completion += len(gen_ids)
        text = (ptext if body.echo else "") + gen_text
        lp = None
        if body.logprobs is not None:
            entries = list(zip(gen_ids, gen_lps))
            if score_prompt:
                entries = list(zip(out.prompt_token_ids, out.prompt_logprobs)) + entries
            lp = completion_logprobs(server, entries, 0)
        finish = "length" if body.max_tokens == 0 else finish_reason(out)
        choices.append({"index": k, "text": text, "logprobs": lp, "finish_reason": finish})
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": server.model_name,
        "system_fingerprint": None,
        "choices": choices,
        "usage": usage(prompt_tokens, completion),
    }
