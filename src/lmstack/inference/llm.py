"""``LLM``: offline batch inference over one ``LLMEngine`` (vLLM's ``LLM.generate`` shape).

CS336 notes "推理流程": the prompts are checked and queued together, then the engine is stepped until
each of this call's requests has finished; outputs come back in prompt order.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import cast

import torch

from lmstack.inference.engine import GenerationError, LLMEngine
from lmstack.inference.loader import AUTO, load_for_inference, weight_format
from lmstack.inference.sampling import SamplingParams
from lmstack.inference.sequence import RequestOutput
from lmstack.kernels.runtime import RuntimeConfig, configure
from lmstack.utils import FLOAT_DTYPES, dtype_name


def _as_prompt_list(prompts) -> list:
    """One prompt (a string or token ids) or many -> a list of prompts."""
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        return [prompts.tolist()] if prompts.dim() == 1 else prompts.tolist()
    if not isinstance(prompts, Iterable) or isinstance(prompts, (bytes, bytearray, dict)):
        raise ValueError(
            f"prompts={prompts!r:.60} must be a prompt (a string or token ids) or a list of prompts"
        )
    return list(prompts)


class LLM:
    """Offline batch inference: ``LLM("smollm2-135m").generate(prompts, SamplingParams(...))``.

    ``model`` is a name (``smollm2-135m``), a .gguf file or checkpoint directory, or a
    Transformer; ``runtime`` a ``lmstack.kernels.RuntimeConfig``: attention/RMSNorm backends and the
    number format (``dtype`` "fp32"/"bf16"/"fp16", or "int8"/"int4": weight-only quantised linears,
    ``lmstack.quant``, the model changed in place). ``dtype=`` / ``quant=`` are shorthands for
    ``runtime.dtype`` (a torch dtype is accepted for ``dtype``; "auto" keeps a quantised GGUF's
    format: int4/int8 linears, ``loader.native_weight_format``). Without ``runtime`` a Transformer
    passed in keeps the backends it has. Engine
    options (block_size, num_blocks, max_num_seqs, max_num_batched_tokens, enable_prefix_caching,
    ...) are passed through to ``LLMEngine``. ``generate`` checks every prompt before queueing
    any (``ValueError``), and raises ``GenerationError`` (holding every output) when some requests
    failed while running; the engine stays usable either way.
    """

    def __init__(
        self,
        model="smollm2-135m",
        tokenizer=None,
        runtime: RuntimeConfig | None = None,
        device: torch.device | str = "cpu",
        *,
        dtype: torch.dtype | str | None = None,
        quant: str | None = None,
        **engine_kwargs,
    ):
        configured = runtime is not None
        runtime = runtime or RuntimeConfig()
        if dtype == AUTO and quant is None:  # the file's own format (``native_weight_format``)
            model, tokenizer = load_for_inference(model, tokenizer, AUTO, device)
            dtype = getattr(model, "quantization", None) or "fp32"
            if configured and runtime.dtype not in ("fp32", dtype):
                raise ValueError(
                    f"dtype='auto' chose {dtype!r} but runtime.dtype={runtime.dtype!r}; set one"
                )
            runtime = replace(runtime, dtype=dtype)
        elif dtype is not None or quant is not None:
            name = (
                (dtype_name(dtype) if dtype_name(dtype) in FLOAT_DTYPES else dtype)
                if isinstance(dtype, torch.dtype)
                else dtype
            )
            weight_format(
                cast(str, name or "fp32"), quant
            )  # a non-float torch dtype: refused there  # names both values when they conflict
            name = quant or name
            if configured and runtime.dtype not in ("fp32", name):
                raise ValueError(
                    f"dtype/quant={name!r} and runtime.dtype={runtime.dtype!r} disagree; set one"
                )
            runtime = replace(runtime, dtype=cast(str, name))
        if dtype != AUTO:
            model, tokenizer = load_for_inference(model, tokenizer, runtime.dtype, device)
        # the backends, resolved once here; without ``runtime`` a model passed in keeps its own
        self.runtime = runtime
        self.runtime_line = configure(model, runtime) if configured else None
        self.engine = LLMEngine(model, tokenizer, **engine_kwargs)
        self.engine.attach(self)
        self._lock = (
            threading.Lock()
        )  # generate() from several threads: one call steps the engine at a time

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. Thread-safe: calls from several
        threads run one after another (each steps the engine until its own requests finish)."""
        with self._lock:
            self.engine.attach(self)
            return self._generate(prompts, sampling_params, use_tqdm)

    def busy(self) -> bool:
        """A ``generate`` call is running (the engine's driver protocol, ``LLMEngine.attach``)."""
        return self._lock.locked()

    def _generate(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"{len(params)} sampling_params for {len(prompt_list)} prompts")
        # every prompt is checked before any is queued: one bad prompt leaves nothing behind
        seqs = [self.engine.check_request(None, p, sp) for p, sp in zip(prompt_list, params)]
        for seq in seqs:
            self.engine.enqueue(seq)
        ids = [seq.request_id for seq in seqs]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:  # an interrupt (or an engine bug) leaves none of this call's requests behind
            for i in ids:
                self.engine.abort_request(i)
            if bar is not None:
                bar.close()
        outputs = [done[i] for i in ids]
        failed = [o for o in outputs if o.error is not None]
        if failed:
            raise GenerationError(
                f"{len(failed)} of {len(outputs)} requests failed (the others finished, see "
                f".outputs): " + "; ".join(str(o.error) for o in failed[:3]),
                outputs,
            )
        return outputs

    def chat(
        self, messages: list[dict], sampling_params: SamplingParams | None = None
    ) -> RequestOutput:
        """One chat turn: render the model's chat template (jinja2) and generate the reply."""
        prompt = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return self.generate([self.tokenizer.encode(prompt)], sampling_params)[0]
