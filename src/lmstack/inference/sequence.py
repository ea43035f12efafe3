"""One request inside the engine: its tokens, progress through the cache, and what it produced.

CS336 notes "动态负载" (a sequence moves waiting → running → finished, and back to waiting when it
is preempted) and "性能指标分析" (arrival, first-token and finish times give TTFT and latency).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmstack.inference.sampling import SamplingParams
from lmstack.inference.stops import StopStrings

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class RequestOutput:
    """What a request has produced so far; ``new_*`` hold the delta since its previous output."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list, repr=False)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    error: str | None = (
        None  # finish_reason "error": what failed (the request was aborted, the engine goes on)
    )
    # SamplingParams.prompt_logprobs: per prompt token (None for the first), (log p(token | prefix), top)
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's state, shared by the scheduler (queues, blocks), the runner (tokens to feed)
    and the engine (its ``RequestOutput``)."""

    request_id: str
    all_ids: list[int]  # prompt + generated tokens
    num_prompt: int
    params: SamplingParams
    arrival: float
    generator: torch.Generator | None  # the request's own (SamplingParams.seed), else the engine's
    stops: StopStrings | None = None  # decoded text and stop strings (needs a tokenizer)
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: str = WAITING
    drafts: list[int] = field(
        default_factory=list
    )  # speculative tokens fed after the last token this step
    draft_probs: torch.Tensor | None = None  # (len(drafts), V): the proposer's q; None = one-hot
    logprobs: list | None = None
    sent_tokens: int = 0  # output tokens already reported
    finish_reason: str | None = None
    error: str | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int | None = (
        None  # prompt tokens served from the prefix cache at first admission
    )
    num_preemptions: int = 0
    prompt_logprobs: list | None = (
        None  # num_prompt entries, filled by the prefill (ModelRunner); [0] stays None
    )

    @property
    def output_ids(self) -> list[int]:
        return self.all_ids[self.num_prompt :]

    @property
    def num_output(self) -> int:
        return len(self.all_ids) - self.num_prompt

    def finish(self, reason: str, now: float) -> None:
        self.status, self.finish_reason, self.finished_time = FINISHED, reason, now
        self.drafts, self.draft_probs = [], None

    def output(self) -> RequestOutput:
        """The request's state now, with the delta since the previous call (text held back while
        it runs: ``StopStrings.emit``)."""
        finished = self.status == FINISHED
        text, new_text = self.stops.emit(finished) if self.stops is not None else ("", "")
        new_ids = self.output_ids[self.sent_tokens :]
        self.sent_tokens += len(new_ids)
        return RequestOutput(
            self.request_id,
            self.all_ids[: self.num_prompt],
            self.output_ids,
            text,
            new_ids,
            new_text,
            finished,
            self.finish_reason,
            list(self.logprobs) if self.logprobs is not None else None,
            self.arrival,
            self.first_token_time,
            self.finished_time,
            list(self.token_times) if finished else [],
            self.num_cached_tokens or 0,
            self.num_preemptions,
            self.error,
            prompt_logprobs=list(self.prompt_logprobs)
            if self.prompt_logprobs is not None
            else None,
        )
