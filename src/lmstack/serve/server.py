"""The server's state: the engine and its async loop, the tokenizer, admission (limits, 429), the request
checks that turn an OpenAI body into engine inputs, and the shutdown drain.

CS336 notes "动态负载" (requests arrive at any time with any length; one engine loop batches them); DESIGN.md
"Real parts" (the OpenAI HTTP API). Every HTTP request becomes ``n`` engine requests on the one
``AsyncLLM``. Bad input is an ``APIError`` (OpenAI's error object) raised before anything reaches the
engine; at most ``max_num_seqs + max_queue`` engine requests are admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request

from lmstack.inference.async_llm import AsyncLLM
from lmstack.inference.engine import GenerationError, LLMEngine
from lmstack.inference.sampling import SamplingParams
from lmstack.serve.metrics import ServerMetrics
from lmstack.serve.penalties import LogitBias, Penalties
from lmstack.serve.protocol import ChatCompletionRequest, error_body

GRAMMAR_FAILED = (
    "structured output: the grammar matcher failed"  # how serve/structured.py's masks fail
)
log = logging.getLogger("lmstack.serve")


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


class Lease:
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
        self.stopping = (
            False  # set by drain(): new requests get 503, running ones end at its deadline
        )
        self._room: asyncio.Condition | None = None
        self._notifiers: set[asyncio.Task] = set()
        self.metrics = ServerMetrics(self)
        self.created = int(time.time())
        self._grammar = None  # structured.Grammars, built on first use

    # ---- admission ---------------------------------------------------------------------
    def pending_adds(self) -> int:
        sched = self.engine.scheduler
        return max(0, self.in_flight - len(sched.running) - len(sched.waiting))

    async def admit(self, k: int) -> Lease:
        """Room for ``k`` engine requests, waiting up to ``queue_timeout`` s; else 429."""
        if self._room is None:
            self._room = asyncio.Condition()
        if k > self.capacity:
            raise APIError(
                400,
                f"{k} choices are more than this server ever runs at once ({self.capacity})",
                param="n",
            )
        if self.in_flight + k > self.capacity and self.queue_timeout > 0 and not self.stopping:
            async with self._room:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._room.wait_for(
                            lambda: self.stopping or self.in_flight + k <= self.capacity
                        ),
                        self.queue_timeout,
                    )
        if self.stopping:
            raise shutting_down("no new requests are taken")
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
        return Lease(self, k)

    def _release(self, k: int) -> None:
        self.in_flight -= k
        self._notify_room()

    def _notify_room(self) -> None:
        """Wake the requests waiting in ``admit`` (room was made, or the server is stopping)."""
        if self._room is not None:
            room = self._room

            async def notify():
                async with room:
                    room.notify_all()

            with contextlib.suppress(RuntimeError):  # no running loop (a finalizer outside it)
                task = asyncio.get_running_loop().create_task(notify())
                self._notifiers.add(task)  # a reference until it ran (the loop keeps weak ones)
                task.add_done_callback(self._notifiers.discard)

    async def drain(self, grace: float) -> None:
        """Shutdown: new requests get 503 at once; those in flight get ``grace`` seconds to finish; then every
        one still running is ended here — its engine requests aborted (blocks freed), a non-streamed request
        answered 503, a stream closed with an error event and ``[DONE]`` (``run`` raises ``shutting_down``)."""
        self.stopping = True
        self._notify_room()
        deadline = time.monotonic() + grace
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.in_flight:
            log.warning(
                "shutdown: ending %d request(s) still running after the %g s grace period",
                self.in_flight,
                grace,
            )
            await self.llm.shutdown()  # each waiter's generate() raises; run() turns it into a 503

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
            # choice i of n: seed + i, kept in 64 bits
            seed = (seed + index + 2**63) % 2**64 - 2**63
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
        """OpenAI fields the server does not implement are refused unless at their no-op value (tool calls are
        ``tools.py``'s, on chat only)."""
        if body.functions or body.function_call not in (None, "none"):
            raise APIError(
                400,
                "functions/function_call (deprecated by OpenAI) are not supported: use tools",
                param="functions" if body.functions else "function_call",
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
        except RuntimeError:  # AsyncLLM.shutdown() ended it: the drain's deadline passed
            if self.stopping:
                raise shutting_down("the request did not finish within the grace period") from None
            raise
        finally:
            if not finished:  # left early: the client went away, or shutdown
                self.metrics.requests.labels("abort").inc()

    def token_text(self, token: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.decode_bytes([token]) if token in self.tokenizer.vocab else b""
        return raw.decode("utf-8", "replace"), list(raw)

    def chat_ids(self, messages, add_generation_prompt: bool, tools=None) -> list[int]:
        """The messages (and ``tools``, the OpenAI tool list, if given) rendered with the model's chat template,
        tokenised and checked."""
        from lmstack.serve.tools import template_messages  # tools.py imports APIError from here

        if not messages:
            raise APIError(400, "messages is empty: give at least one message", param="messages")
        msgs = template_messages(messages, self.tokenizer.chat_template)
        try:
            text = self.tokenizer.apply_chat_template(
                msgs,
                add_generation_prompt=add_generation_prompt,
                **({"tools": tools} if tools else {}),
            )
        except ValueError as e:  # ChatTemplateError: no template, or the template rejected them
            raise APIError(400, f"messages: {e}", param="messages") from None
        return self.token_ids(self.tokenizer.encode(text), "messages")

    def structured(self, body: ChatCompletionRequest, tool_plan=None):
        """Per choice, the grammar's logits processor (``structured.py``), or None for free text: the
        ``response_format``'s, or a tool call's (``tools.ToolPlan.schema``: tool_choice required or named)."""
        fmt = body.response_format
        if tool_plan is not None and fmt is not None and fmt.type != "text":
            raise APIError(
                400,
                "response_format cannot be combined with tools (a tool call's arguments are already JSON)",
                param="response_format",
            )
        if tool_plan is not None and tool_plan.schema is not None:
            return self._masks(tool_plan.schema, body.n, "tools")
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(
                    400,
                    "response_format json_schema needs json_schema.schema",
                    param="response_format",
                )
            schema = fmt.json_schema.schema_
        else:
            schema = None
        return self._masks(schema, body.n, "response_format")

    def _masks(self, schema: dict | None, n: int, param: str) -> list[list]:
        from lmstack.serve import structured  # llguidance: only for requests that ask for it

        if self._grammar is None:
            self._grammar = structured.Grammars(
                self.tokenizer, self.engine.config.vocab_size, self.engine.scheduler.eos_token_id
            )
        try:
            return [[self._grammar.processor(schema)] for _ in range(n)]
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None


def shutting_down(why: str) -> APIError:
    """The 503 a request gets while the server shuts down (OpenAI's code for an unavailable server)."""
    return APIError(
        503,
        f"the server is shutting down: {why}; retry later",
        "server_error",
        None,
        "server_shutting_down",
    )


def server_of(request: Request) -> Server:
    """The ``Server`` behind the app (a FastAPI dependency of every route)."""
    return request.app.state.server


#: a route's ``server`` parameter: ``async def route(body: ..., server: ServerDep)``
ServerDep = Annotated[Server, Depends(server_of)]


def engine_error(e: GenerationError) -> APIError:
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
