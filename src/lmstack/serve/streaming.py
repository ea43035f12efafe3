"""Streaming: OpenAI's server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``), the merge of
a request's ``n`` engine streams, and the non-streamed wait that gives up when the client leaves.

Per choice a stream sends its text deltas in order and exactly one chunk with a ``finish_reason``, last;
streamed logprobs carry the same tokens and cumulative ``text_offset`` as the non-streamed answer; with
``stream_options.include_usage`` a final chunk with empty ``choices`` holds the usage. A request that
fails (in the engine, or when the server shuts down) ends its stream with an error event, then
``[DONE]``. Leaving a stream early cancels its engine requests (their KV blocks are freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from lmstack.inference.engine import GenerationError
from lmstack.serve.responses import chat_logprobs, completion_logprobs, finish_reason, usage
from lmstack.serve.server import APIError, Lease, Server, engine_error


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


async def until_disconnect(request: Request, work):
    """Await ``work`` unless the client goes away first (then it is cancelled, its requests aborted, and the
    answer is 499). Cancelled itself (the server's task), it cancels ``work`` and stays cancelled."""
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
    if task.cancelled():  # the watcher saw the client go
        raise APIError(499, "the client closed the request", "client_closed")
    return task.result()


async def collect(gens: list[AsyncIterator]) -> list:
    """Every request's final output (each iterator's last item)."""
    last: dict[int, object] = {}
    async for i, out in _merge(gens):
        last[i] = out
    return [last[i] for i in range(len(gens))]


def streaming_response(lease: Lease, body: AsyncIterator[str]) -> StreamingResponse:
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

    def chunk(choices, totals=None):
        c = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": server.model_name,
            "system_fingerprint": None,
            "choices": choices,
        }
        if include_usage:
            c["usage"] = totals
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
    """Relay ``gen_events``; a failure (in the engine, or the shutdown's deadline) ends the stream with its
    error object as an event, then [DONE]; else usage (if asked) and [DONE]."""
    try:
        async for event in gen_events:
            yield event
    except (GenerationError, APIError) as e:
        yield _sse((engine_error(e) if isinstance(e, GenerationError) else e).body())
        yield "data: [DONE]\n\n"
        return
    if include_usage:
        completion = sum(counts)
        yield chunk([], usage(prompt_tokens, completion))
    yield "data: [DONE]\n\n"


async def chat_stream(
    server: Server, gens, rid, created, prompt_tokens, include_usage, logprobs, tool_outputs=None
):
    """Chat chunks; with tools (``tool_outputs``: one ``tools.ToolOutput`` per choice) the deltas are
    ``content`` and/or ``tool_calls`` (index, then id/type/name, then ``arguments`` fragments), as OpenAI's."""
    chunk = _chunker(server, rid, created, "chat.completion.chunk", include_usage)
    completion = [0]

    def piece(i, delta, lp=None, finish=None):
        return chunk([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}])

    async def events():
        first = {"role": "assistant", "content": None if tool_outputs else ""}
        for i in range(len(gens)):
            yield piece(i, dict(first))
        sent_lp = [0] * len(gens)
        async for i, out in _merge(gens):
            lp = None
            if logprobs is not None and out.logprobs is not None:
                new = _new_logprobs(out, sent_lp, i)
                lp = chat_logprobs(server, new) if new else None
            to = tool_outputs[i] if tool_outputs else None
            deltas = to.deltas(out.text, out.finished) if to else [{"content": out.new_text}]
            deltas = [d for d in deltas if d != {"content": ""}]
            if lp is not None and not deltas:  # logprobs of tokens that made no text yet
                deltas = [{} if to else {"content": ""}]
            for k, delta in enumerate(deltas):
                yield piece(i, delta, lp if k == 0 else None)
            if out.finished:
                completion[0] += len(out.token_ids)
                yield piece(i, {}, None, finish_reason(out, to))

    async for event in _stream_tail(events(), chunk, prompt_tokens, include_usage, completion):
        yield event


async def completion_stream(
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
                lp = completion_logprobs(server, new, offsets[k]) if new else None
                if lp:
                    offsets[k] += sum(len(t) for t in lp["tokens"])
            if out.new_text or lp is not None or out.finished:
                yield chunk(
                    [
                        {
                            "index": k,
                            "text": out.new_text,
                            "logprobs": lp,
                            "finish_reason": finish_reason(out),
                        }
                    ]
                )
            if out.finished:
                completion[0] += len(out.token_ids)

    async for event in _stream_tail(events(), chunk, prompt_tokens, include_usage, completion):
        yield event
