"""``AsyncLLM``: the streaming API an asyncio server sits on, over one ``LLMEngine``.

CS336 notes "动态负载": requests arrive and leave (client disconnects) while the engine runs; they are
applied between iterations, so one thread at a time touches the engine, through its public methods
(``add_request``, ``abort_request``, ``abort_all``, ``step``, ``new_request_id``).

A burst that reaches an idle engine is gathered into its first step: after the first request the loop
waits while more keep arriving (``gather_s`` apart, at most ``max_gather_s`` in all) before it steps. Without
it the first step took whatever had been tokenised so far, and the rest of the burst — whose parsing and
tokenisation then ran against the step's thread for the GIL and the cores — waited for that whole step and
one more (16 simultaneous requests on a 2-core CPU: 8 + 8 over two steps, TTFT p50 one step longer;
docs/log/inference.md). A lone request pays one ``gather_s``. vLLM's ``scheduler_delay_factor`` delays prompts
for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from lmstack.inference.engine import GenerationError, LLMEngine
from lmstack.inference.sampling import SamplingParams
from lmstack.inference.sequence import RequestOutput


class AsyncLLM:
    """Streaming API over one ``LLMEngine`` for an asyncio server.

    ``generate`` adds a request and yields ``RequestOutput`` deltas as tokens arrive; leaving
    the iterator early (a client disconnect) aborts the request and frees its blocks.
    The engine steps in a worker thread, step after step while there is nothing to apply; requests
    added or aborted meanwhile end that run after its current step and are applied by the loop between
    steps, so the engine is never touched by two threads at once.
    """

    def __init__(
        self, engine: LLMEngine, gather_s: float = 0.002, max_gather_s: float = 0.02
    ) -> None:
        if not (0 <= gather_s <= max_gather_s):
            raise ValueError(
                f"gather_s={gather_s!r}, max_gather_s={max_gather_s!r}: expected "
                "0 <= gather_s <= max_gather_s (seconds an idle engine waits for a burst; 0: none)"
            )
        engine.attach(self)
        self.engine = engine
        self.gather_s, self.max_gather_s = gather_s, max_gather_s
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list[tuple] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def busy(self) -> bool:
        """Streams in flight or requests waiting to be added (``LLMEngine.attach``)."""
        return bool(self._queues or self._pending)

    def add_request(
        self, request_id: str, prompt, params: SamplingParams | None = None
    ) -> asyncio.Queue:
        params = params or SamplingParams()
        self.engine.attach(self)
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already streaming")
        self._ensure_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._pending.append(("add", request_id, prompt, params))
        assert self._wakeup is not None  # made by _ensure_loop
        self._wakeup.set()
        return q

    def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self._pending.append(("abort", request_id))
            if self._wakeup is not None:
                self._wakeup.set()

    async def generate(
        self, prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        request_id = request_id or self.engine.new_request_id("async")
        q = self.add_request(request_id, prompt, params)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    @property
    def alive(self) -> bool:
        """False once the loop task has died of an exception (it restarts on the next request)."""
        t = self._task
        return t is None or not t.done() or t.cancelled() or t.exception() is None

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request (blocks freed; each waiter's ``generate`` raises RuntimeError) and stop
        the loop task. The loop applies the aborts between steps, never while a step runs in its thread."""
        for rid, q in list(self._queues.items()):
            q.put_nowait(RuntimeError(f"request {rid!r} aborted: the engine is shutting down"))
            self.abort(rid)
        task, deadline = self._task, time.monotonic() + timeout
        while (
            task is not None and not task.done() and self._pending and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.005)
        self._task = None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for op in pending:
            if op[0] == "add":
                _, rid, prompt, params = op
                try:
                    self.engine.add_request(rid, prompt, params)
                except Exception as e:  # noqa: BLE001 — whatever the bad request raises goes to its caller
                    q = self._queues.pop(rid, None)
                    if q is not None:
                        q.put_nowait(e)
            else:
                self.engine.abort_request(op[1])

    def _deliver(self, out: RequestOutput) -> None:
        q = self._queues.get(out.request_id)
        if q is None:
            return
        if out.error is not None:
            q.put_nowait(GenerationError(out.error, [out]))
        else:
            q.put_nowait(out)
        if out.finished:
            self._queues.pop(out.request_id, None)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out)

    def _steps(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task | None) -> None:
        """In the worker thread: engine steps one after another, each step's outputs handed to the loop as it
        ends, until the loop has requests to add or abort (applied between steps, by the loop) or nothing is
        left. One hand-off per run of steps instead of per step: the next step starts without waiting for the
        loop thread to wake (docs/log/serving.md). A loop task that is no longer this driver's (``shutdown``) ends
        the run after its current step, as a cancelled hand-off of one step did."""
        while True:
            outputs = self.engine.step()
            loop.call_soon_threadsafe(self._deliver_all, outputs)
            if self._pending or self._task is not task or not self.engine.has_unfinished_requests():
                return

    def _fail_all(self, error: Exception) -> None:
        """The engine loop itself failed: every waiter gets the error, every request is aborted
        (blocks freed), and the loop goes on serving new requests."""
        for q in self._queues.values():
            q.put_nowait(error)
        self._queues.clear()
        self.engine.abort_all()

    async def _gather(self) -> None:
        """An idle engine's first request has arrived: wait while more keep coming (each within ``gather_s``
        of the previous one, ``max_gather_s`` in all), so that a burst shares the first step."""
        if self.gather_s <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_gather_s
        seen = len(self._pending)
        while loop.time() + self.gather_s <= deadline:
            await asyncio.sleep(self.gather_s)
            if len(self._pending) == seen:
                return
            seen = len(self._pending)

    async def _run(self) -> None:
        while True:
            try:
                if not self.engine.has_unfinished_requests() and any(
                    op[0] == "add" for op in self._pending
                ):
                    await (
                        self._gather()
                    )  # an idle engine's first request: the rest of a burst joins it
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    assert self._wakeup is not None  # made by _ensure_loop before the loop runs
                    self._wakeup.clear()
                    if self._pending:
                        continue
                    await self._wakeup.wait()
                    continue
                await asyncio.to_thread(
                    self._steps, asyncio.get_running_loop(), asyncio.current_task()
                )
            except Exception as e:  # noqa: BLE001 — never a dead loop with callers waiting on it
                self._fail_all(e)
