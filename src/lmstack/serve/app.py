"""The OpenAI-compatible HTTP server: one engine loop (``AsyncLLM``) behind a FastAPI app.

Seed 000 §2.1–2.2 (latency vs throughput; continuous batching), seed 001 "推理" / "动态负载"
(requests arrive at any time with any length; iteration-level scheduling over a paged KV cache;
TTFT and per-token latency are what users see); DESIGN.md "Real parts" (FastAPI + uvicorn, the
OpenAI HTTP API). Every HTTP request becomes ``n`` engine requests on the one ``AsyncLLM``; the
engine batches them with everything else in flight.

- Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE
  streaming as OpenAI: ``data: {chunk}`` lines, ``data: [DONE]``, a usage chunk with
  ``stream_options.include_usage``), ``GET /health``, ``GET /metrics``, ``POST /tokenize``,
  ``POST /detokenize``, ``GET /`` (the chat page, ``static/index.html``).
- Bad input is a 4xx with OpenAI's error object, checked before anything reaches the engine
  (the engine's own ``check_request`` included); a failure while running stays with its request.
- Load: at most ``max_num_seqs + max_queue`` engine requests are admitted; beyond that a request
  waits up to ``queue_timeout`` seconds for room, then gets 429.
- A client that goes away (streaming or not) aborts its engine requests, freeing their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmstack.inference.engine import AsyncLLM, GenerationError, LLMEngine
from lmstack.inference.sampling import SamplingParams
from lmstack.serve.metrics import ServerMetrics
from lmstack.serve.penalties import LogitBias, Penalties
from lmstack.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)

GRAMMAR_FAILED = (
    "structured output: the grammar matcher failed"  # how serve/structured.py's masks fail
)
log = logging.getLogger("lmstack.serve")
STATIC = Path(__file__).parent / "static"


class APIError(Exception):
    """An error answered with OpenAI's error object and ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


class _Lease:
    """``k`` admitted engine requests; released once (by the stream's end, or when the stream
    object is dropped without ever being started)."""

    def __init__(self, server: Server, k: int):
        self.server, self.k = server, k

    def release(self) -> None:
        if self.k:
            self.server._release(self.k)
            self.k = 0


class Server:
    """The state behind the app: the engine, its async loop, the tokenizer, admission, metrics."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        *,
        api_key: str | None = None,
        max_queue: int = 256,
        queue_timeout: float = 0.0,
        max_n: int = 16,
        max_body_bytes: int = 4 * 2**20,
        public_metrics: bool = False,
    ):
        if engine.tokenizer is None:
            raise ValueError("the server needs an engine with a tokenizer (text in, text out)")
        if max_queue < 0 or queue_timeout < 0 or max_n < 1:
            raise ValueError(
                f"max_queue={max_queue}, queue_timeout={queue_timeout} must be >= 0, max_n={max_n} >= 1"
            )
        self.engine, self.llm = engine, AsyncLLM(engine)
        self.tokenizer = engine.tokenizer
        if api_key is not None and not api_key.strip():
            raise ValueError(
                "api_key is empty: pass a non-empty key, or None to serve without authentication"
            )
        self.model_name, self.api_key = model_name, api_key
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={max_body_bytes}; expected >= 1")
        self.max_body_bytes, self.public_metrics = max_body_bytes, public_metrics
        self.capacity = engine.scheduler.max_num_seqs + max_queue
        self.queue_timeout, self.max_n = queue_timeout, max_n
        self.in_flight = 0
        self._room: asyncio.Condition | None = None
        self._notifiers: set[asyncio.Task] = set()
        self.metrics = ServerMetrics(self)
        self.created = int(time.time())
        self._grammar = None  # structured.Grammars, built on first use

    # ---- admission ---------------------------------------------------------------------
    def pending_adds(self) -> int:
        sched = self.engine.scheduler
        return max(0, self.in_flight - len(sched.running) - len(sched.waiting))

    async def admit(self, k: int) -> _Lease:
        """Room for ``k`` engine requests, waiting up to ``queue_timeout`` s; else 429."""
        if self._room is None:
            self._room = asyncio.Condition()
        if k > self.capacity:
            raise APIError(
                400,
                f"{k} choices are more than this server ever runs at once ({self.capacity})",
                param="n",
            )
        if self.in_flight + k > self.capacity and self.queue_timeout > 0:
            async with self._room:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._room.wait_for(lambda: self.in_flight + k <= self.capacity),
                        self.queue_timeout,
                    )
        if self.in_flight + k > self.capacity:
            self.metrics.rejected.inc()
            raise APIError(
                429,
                f"the server is at capacity ({self.in_flight} requests in flight, at most "
                f"{self.capacity}); retry later",
                "rate_limit_error",
                None,
                "queue_full",
            )
        self.in_flight += k
        return _Lease(self, k)

    def _release(self, k: int) -> None:
        self.in_flight -= k
        if self._room is not None:
            room = self._room

            async def notify():
                async with room:
                    room.notify_all()

            with contextlib.suppress(RuntimeError):  # no running loop (a finalizer outside it)
                task = asyncio.get_running_loop().create_task(notify())
                self._notifiers.add(
                    task
                )  # a reference until it ran (the loop keeps only weak ones)
                task.add_done_callback(self._notifiers.discard)

    # ---- checks ------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise APIError(400, f"n={n} is more than this server allows ({self.max_n})", param="n")

    def token_ids(self, prompt, param: str) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise APIError(
                400, f"{param} is empty: generation needs at least one prompt token", param=param
            )
        V = self.engine.config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise APIError(
                400,
                f"{param}: token ids {bad[:5]} are outside the vocabulary [0, {V})",
                param=param,
            )
        return ids

    def max_tokens(self, ids: list[int], asked: int | None) -> int:
        """``asked`` checked against the context; None = all the room left."""
        room = self.engine.max_model_len - len(ids)
        room = min(room, self.engine.cache.blocks.capacity_tokens - len(ids))
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens, which leaves no room to generate within this "
                f"model's context of {self.engine.max_model_len} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        if asked is None:
            return room
        if len(ids) + asked > self.engine.max_model_len:
            raise APIError(
                400,
                f"this model's maximum context length is {self.engine.max_model_len} tokens, but "
                f"{len(ids) + asked} were requested ({len(ids)} in the prompt, {asked} for the "
                "completion); lower max_tokens or the prompt",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return asked

    def sampling(
        self, body, max_tokens: int, logprobs: int | None, index: int, processors=()
    ) -> SamplingParams:
        seed = body.seed
        if seed is not None and index:
            seed = (
                seed + index + 2**63
            ) % 2**64 - 2**63  # choice i of n: seed + i, kept in 64 bits
        procs = list(processors)
        if body.logit_bias:
            procs.append(LogitBias(self.logit_bias(body.logit_bias)))
        if body.presence_penalty or body.frequency_penalty:
            procs.append(Penalties(body.presence_penalty or 0.0, body.frequency_penalty or 0.0))
        stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        try:
            return SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k,
                min_p=body.min_p or 0.0,
                repetition_penalty=body.repetition_penalty or 1.0,
                max_tokens=max_tokens,
                stop=stop,
                stop_token_ids=body.stop_token_ids or (),
                ignore_eos=body.ignore_eos,
                seed=seed,
                logprobs=logprobs,
                logits_processors=procs,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def logit_bias(self, bias: dict[str, float]) -> dict[int, float]:
        """``logit_bias``'s keys are token ids as strings (JSON object keys): each in the vocabulary."""
        V = self.engine.config.vocab_size
        out = {}
        for key, value in bias.items():
            try:
                tid = int(key)
            except ValueError:
                raise APIError(
                    400, f"logit_bias key {key!r} is not a token id", param="logit_bias"
                ) from None
            if not 0 <= tid < V:
                raise APIError(
                    400,
                    f"logit_bias token {tid} is outside the vocabulary [0, {V})",
                    param="logit_bias",
                )
            out[tid] = value
        return out

    @staticmethod
    def unsupported(body) -> None:
        """OpenAI fields the server does not implement are refused unless at their no-op value."""
        if body.tools or body.functions:
            raise APIError(
                400, "tool calls are not supported by this server (tools/functions)", param="tools"
            )
        if body.tool_choice not in (None, "none") or body.function_call not in (None, "none"):
            raise APIError(400, "tool_choice is not supported (no tools)", param="tool_choice")
        if body.parallel_tool_calls:
            raise APIError(
                400, "parallel_tool_calls is not supported (no tools)", param="parallel_tool_calls"
            )
        if body.modalities not in (None, ["text"]) or body.audio is not None:
            raise APIError(
                400, "only text output is supported (modalities ['text'])", param="modalities"
            )
        if body.best_of not in (None, 1) and body.best_of != body.n:
            raise APIError(
                400, f"best_of={body.best_of} is not supported (only best_of = n)", param="best_of"
            )

    def precheck(self, ids: list[int], params: SamplingParams) -> None:
        """The engine's own checks, without queueing anything."""
        try:
            self.engine.check_request(f"check-{uuid.uuid4().hex}", ids, params)
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_request") from None

    # ---- running -----------------------------------------------------------------------
    async def run(self, ids: list[int], params: SamplingParams, rid: str) -> AsyncIterator:
        """The engine's deltas for one request; metrics on the way; an abort when left early."""
        finished = False
        try:
            async for out in self.llm.generate(ids, params, rid):
                self.metrics.tokens(len(out.new_token_ids))
                if out.finished:
                    finished = True
                    self.metrics.finished(out)
                yield out
        except GenerationError:
            finished = True
            self.metrics.requests.labels("error").inc()
            raise
        finally:
            if not finished:  # left early: the client went away, or shutdown
                self.metrics.requests.labels("abort").inc()

    def token_text(self, token: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.decode_bytes([token]) if token in self.tokenizer.vocab else b""
        return raw.decode("utf-8", "replace"), list(raw)


# ---- response pieces ---------------------------------------------------------------------
def _chat_logprobs(server: Server, entries) -> dict:
    content = []
    for token, (lp, top) in entries:
        text, raw = server.token_text(token)
        tops = []
        for t, v in sorted(top.items(), key=lambda kv: -kv[1]):
            tt, tr = server.token_text(t)
            tops.append({"token": tt, "logprob": v, "bytes": tr})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": tops})
    return {"content": content, "refusal": None}


def _completion_logprobs(server: Server, entries, offset: int) -> dict:
    """OpenAI's legacy logprobs object over (token, (logprob, top) or None) entries; None (the first
    prompt token under ``echo``: nothing precedes it) gives null logprob and top_logprobs."""
    tokens, lps, tops, offsets = [], [], [], []
    for token, entry in entries:
        text, _ = server.token_text(token)
        tokens.append(text)
        if entry is None:
            lps.append(None)
            tops.append(None)
        else:
            lp, top = entry
            lps.append(lp)
            d: dict[str, float] = {}
            for t, v in sorted(top.items(), key=lambda kv: -kv[1]):
                d.setdefault(
                    server.token_text(t)[0], v
                )  # two tokens with one text (partial UTF-8): the likelier
            tops.append(d)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _finish_reason(out) -> str | None:
    """The engine's reasons ("stop", "length") are OpenAI's; None while running."""
    return out.finish_reason if out.finished else None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(index, item) from several async iterators as they come; an exception ends it; leaving it
    early cancels the rest (each iterator's cleanup aborts its engine request)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for item in gen:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 — handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnect(request: Request, work):
    """Await ``work`` unless the client goes away first (then it is cancelled: requests aborted)."""
    task = asyncio.ensure_future(work)

    async def watch():
        while not await request.is_disconnected():
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise APIError(499, "the client closed the request", "client_closed")
    return task.result()


def _engine_error(e: GenerationError) -> APIError:
    """A request that failed in the engine: a 500, except when the request's own JSON schema is what failed (the
    grammar matcher gave up mid-generation: too complex a pattern, an unsatisfiable structure) — a 400."""
    if GRAMMAR_FAILED in str(e):
        return APIError(
            400,
            f"response_format: the JSON schema cannot be followed: {e}",
            param="response_format",
            code="invalid_schema",
        )
    return APIError(
        500, f"the request failed in the engine: {e}", "server_error", code="engine_error"
    )


# ---- the app -----------------------------------------------------------------------------
def build_app(server: Server) -> FastAPI:
    """The FastAPI app over ``server`` (``Server``)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await (
            server.llm.shutdown()
        )  # every request still in the engine aborted (blocks freed), the loop stopped

    app = FastAPI(
        title="lmstack",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible API over lmstack's continuous-batching engine",
    )
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        # a union field reports one error per branch: the validator's own message (value_error) says most
        first = next((x for x in errs if x.get("type") == "value_error"), errs[0] if errs else {})
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg = f"the request body is not valid JSON: {first.get('msg')}"
        else:
            msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
            if len(errs) > 1:
                msg += f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})"
        param = (
            loc[0] if loc and first.get("type") != "json_invalid" else None
        )  # (a JSON error's loc is an offset)
        return JSONResponse(error_body(msg, param=param, code="invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(
            error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(
            error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500
        )

    app.add_middleware(_BodyLimit, server=server)
    app.add_middleware(
        _BearerAuth, server=server
    )  # added last: runs first (no key, no body read at all)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not server.llm.alive:
            raise APIError(
                503, "the engine loop died (it restarts with the next request)", "server_error"
            )
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(
            server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)
    async def chat_page():
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": server.model_name,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "lmstack",
                    "max_model_len": server.engine.max_model_len,
                }
            ],
        }

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(
                400, "give exactly one of prompt (text) or messages (chat)", param="prompt"
            )
        if (
            body.messages is not None
        ):  # tokenising a large body takes seconds: never on the event loop
            ids = await run_in_threadpool(
                _chat_ids, server, body.messages, body.add_generation_prompt
            )
        else:
            ids = await run_in_threadpool(server.tokenizer.encode, body.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": server.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
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

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_model(body.model)
        server.check_n(body.n)
        server.unsupported(body)
        ids = await run_in_threadpool(
            _chat_ids, server, body.messages, True
        )  # CPU work off the event loop
        asked = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        max_tokens = server.max_tokens(ids, asked)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        processors = _structured(server, body)
        params = [
            server.sampling(body, max_tokens, logprobs, i, processors[i] if processors else ())
            for i in range(body.n)
        ]
        server.precheck(ids, params[0])
        lease = await server.admit(body.n)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gens = [server.run(ids, p, f"{rid}-{i}") for i, p in enumerate(params)]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _streaming(
                lease, _chat_stream(server, gens, rid, created, len(ids), include_usage, logprobs)
            )
        try:
            outs = await _until_disconnect(request, _collect(gens))
        except GenerationError as e:
            raise _engine_error(e) from None
        finally:
            lease.release()
        choices = []
        for i, out in enumerate(outs):
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": out.text, "refusal": None},
                    "logprobs": _chat_logprobs(server, zip(out.token_ids, out.logprobs))
                    if logprobs is not None
                    else None,
                    "finish_reason": _finish_reason(out),
                }
            )
        completion = sum(len(o.token_ids) for o in outs)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": server.model_name,
            "system_fingerprint": None,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": completion,
                "total_tokens": len(ids) + completion,
            },
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body.model)
        server.check_n(body.n)
        server.unsupported(body)
        if body.suffix:
            raise APIError(
                400, "suffix is not supported (no fill-in-the-middle template)", param="suffix"
            )
        score_prompt = (
            body.echo and body.logprobs is not None
        )  # the prompt's own logprobs (prefill)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(
                400,
                "max_tokens=0 only makes sense with echo=true (score the prompt, generate nothing)",
                param="max_tokens",
            )
        if score_prompt and body.stream:
            raise APIError(
                400, "echo with logprobs is not supported with stream=true", param="stream"
            )
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
            ids = server.token_ids(p, "prompt" if len(prompts) == 1 else f"prompt[{j}]")
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
            return _streaming(
                lease,
                _completion_stream(
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
            outs = await _until_disconnect(request, _collect(gens))
        except GenerationError as e:
            raise _engine_error(e) from None
        finally:
            lease.release()
        choices = []
        completion = 0
        for k, ((_, ptext, _), out) in enumerate(zip(jobs, outs)):
            gen_ids, gen_lps, gen_text = out.token_ids, out.logprobs, out.text
            if (
                body.max_tokens == 0
            ):  # echo only: the one token the engine made is not part of the answer
                gen_ids, gen_lps, gen_text = [], [], ""
            completion += len(gen_ids)
            text = (ptext if body.echo else "") + gen_text
            lp = None
            if body.logprobs is not None:
                entries = list(zip(gen_ids, gen_lps))
                if score_prompt:
                    entries = list(zip(out.prompt_token_ids, out.prompt_logprobs)) + entries
                lp = _completion_logprobs(server, entries, 0)
            finish = "length" if body.max_tokens == 0 else _finish_reason(out)
            choices.append({"index": k, "text": text, "logprobs": lp, "finish_reason": finish})
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": server.model_name,
            "system_fingerprint": None,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            },
        }

    return app


#: routes that answer without the API key: liveness, the chat page (it asks for the key itself), and /metrics
#: when the server is started with ``public_metrics`` (a Prometheus scraper without the key)
PUBLIC_ROUTES = ("/health", "/")


def _protected(path: str, public_metrics: bool) -> bool:
    """With an API key every route needs it — /v1/*, /tokenize, /detokenize, /docs, /openapi.json, /metrics and
    any route added later — except ``PUBLIC_ROUTES`` (and /metrics with ``public_metrics``)."""
    if path in PUBLIC_ROUTES:
        return False
    return not (public_metrics and path == "/metrics")


class _BodyLimit:
    """Request bodies above ``server.max_body_bytes`` get a 413 before the route reads them (a declared
    Content-Length), or as soon as a streamed body passes the limit: one client's huge body cannot hold the
    event loop or the memory."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.server.max_body_bytes
        too_large = JSONResponse(
            error_body(
                f"the request body is larger than this server accepts ({limit} bytes)",
                code="request_too_large",
            ),
            status_code=413,
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await too_large(scope, receive, send)
        seen = 0

        async def counted():  # a body without Content-Length (chunked): stop reading it at the limit
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if (
                    seen > limit
                ):  # FastAPI passes an HTTPException through its body parsing: a 413 error object
                    raise StarletteHTTPException(
                        413, f"the request body is larger than this server accepts ({limit} bytes)"
                    )
            return message

        await self.app(scope, counted, send)


class _BearerAuth:
    """``Authorization: Bearer KEY`` on /v1/*, /tokenize, /detokenize when the server has a key. A plain
    ASGI middleware: Starlette's ``BaseHTTPMiddleware`` would hide client disconnects from the routes."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        key = self.server.api_key
        path = scope.get("path", "")
        if key and scope["type"] == "http" and _protected(path, self.server.public_metrics):
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {key}":
                response = JSONResponse(
                    error_body(
                        "invalid or missing API key (Authorization: Bearer KEY)",
                        code="invalid_api_key",
                    ),
                    status_code=401,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _chat_ids(server: Server, messages, add_generation_prompt: bool) -> list[int]:
    if not messages:
        raise APIError(400, "messages is empty: give at least one message", param="messages")
    msgs = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]
    try:
        text = server.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=add_generation_prompt
        )
    except ValueError as e:  # ChatTemplateError: no template, or the template rejected the messages
        raise APIError(400, f"messages: {e}", param="messages") from None
    return server.token_ids(server.tokenizer.encode(text), "messages")


def _structured(server: Server, body: ChatCompletionRequest):
    """Per choice, the grammar's logits processor (``structured.py``), or None for free text."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    from lmstack.serve import (
        structured,
    )  # llguidance: only for requests that ask for structured output

    if server._grammar is None:
        server._grammar = structured.Grammars(
            server.tokenizer, server.engine.config.vocab_size, server.engine.scheduler.eos_token_id
        )
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(
                400, "response_format json_schema needs json_schema.schema", param="response_format"
            )
        schema = fmt.json_schema.schema_
    else:
        schema = None
    try:
        return [[server._grammar.processor(schema)] for _ in range(body.n)]
    except ValueError as e:
        raise APIError(400, f"response_format: {e}", param="response_format") from None


async def _collect(gens: list[AsyncIterator]) -> list:
    """Every request's final output (each iterator's last item)."""
    last: dict[int, object] = {}
    async for i, out in _merge(gens):
        last[i] = out
    return [last[i] for i in range(len(gens))]


def _streaming(lease: _Lease, body: AsyncIterator[str]) -> StreamingResponse:
    async def stream():
        try:
            async for chunk in body:
                yield chunk
        finally:
            lease.release()

    gen = stream()
    weakref.finalize(
        gen, lease.release
    )  # a stream never started (client gone at once) releases too
    return StreamingResponse(
        gen,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _chunker(server: Server, rid, created, obj: str, include_usage: bool):
    """One SSE chunk of a stream of ``obj`` ("chat.completion.chunk" / "text_completion"); usage only when asked."""

    def chunk(choices, usage=None):
        c = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": server.model_name,
            "system_fingerprint": None,
            "choices": choices,
        }
        if include_usage:
            c["usage"] = usage
        return _sse(c)

    return chunk


def _new_logprobs(out, sent: list[int], i: int) -> list[tuple[int, tuple]]:
    """(token, logprobs) of stream ``i``'s tokens not yet sent (``sent[i]`` counts them; advanced here)."""
    new = list(zip(out.token_ids[sent[i] :], out.logprobs[sent[i] :]))
    sent[i] += len(new)
    return new


async def _stream_tail(
    gen_events, chunk, prompt_tokens: int, include_usage: bool, counts: list[int]
):
    """Relay ``gen_events``; an engine error ends the stream with its error body; then usage (if asked) and [DONE]."""
    try:
        async for event in gen_events:
            yield event
    except GenerationError as e:
        yield _sse(_engine_error(e).body())
        yield "data: [DONE]\n\n"
        return
    if include_usage:
        completion = sum(counts)
        yield chunk(
            [],
            {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            },
        )
    yield "data: [DONE]\n\n"


async def _chat_stream(server: Server, gens, rid, created, prompt_tokens, include_usage, logprobs):
    chunk = _chunker(server, rid, created, "chat.completion.chunk", include_usage)
    completion = [0]

    async def events():
        for i in range(len(gens)):
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        sent_lp = [0] * len(gens)
        async for i, out in _merge(gens):
            lp = None
            if logprobs is not None and out.logprobs is not None:
                new = _new_logprobs(out, sent_lp, i)
                lp = _chat_logprobs(server, new) if new else None
            if out.new_text or lp is not None:
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"content": out.new_text},
                            "logprobs": lp,
                            "finish_reason": None,
                        }
                    ]
                )
            if out.finished:
                completion[0] += len(out.token_ids)
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {},
                            "logprobs": None,
                            "finish_reason": _finish_reason(out),
                        }
                    ]
                )

    async for event in _stream_tail(events(), chunk, prompt_tokens, include_usage, completion):
        yield event


async def _completion_stream(
    server: Server, gens, jobs, rid, created, prompt_tokens, include_usage, echo, logprobs
):
    chunk = _chunker(server, rid, created, "text_completion", include_usage)
    completion = [0]

    async def events():
        if echo:
            for k, (_, ptext, _) in enumerate(jobs):
                yield chunk([{"index": k, "text": ptext, "logprobs": None, "finish_reason": None}])
        sent_lp = [0] * len(gens)
        offsets = [0] * len(gens)
        async for k, out in _merge(gens):
            lp = None
            if logprobs is not None and out.logprobs is not None:
                new = _new_logprobs(out, sent_lp, k)
                lp = _completion_logprobs(server, new, offsets[k]) if new else None
                if lp:
                    offsets[k] += sum(len(t) for t in lp["tokens"])
            if out.new_text or lp is not None or out.finished:
                yield chunk(
                    [
                        {
                            "index": k,
                            "text": out.new_text,
                            "logprobs": lp,
                            "finish_reason": _finish_reason(out),
                        }
                    ]
                )
            if out.finished:
                completion[0] += len(out.token_ids)

    async for event in _stream_tail(events(), chunk, prompt_tokens, include_usage, completion):
        yield event
