"""The fast batch-1 decode path: a static KV cache and a decode step compiled once.

Book of LLMs §2.4 (KV cache), CS336 notes "推理流程" (decode is one token per step and memory-bound:
the weights are read once per token, everything else is overhead). ``StaticKVCache`` has fixed
shapes (B, K, S_max, H) per layer and writes with ``index_copy_`` at tensor positions, so a decode
step never reads a value back to the host and never changes shape; ``torch.compile`` can then
turn the whole step (30 layers of norms, RoPE, attention, SwiGLU) into one graph of fused
kernels with no Python per op. Empty slots carry position −1 and the model's mask hides them.
The cache itself lives with the others in ``inference.kv_cache``.
"""

from __future__ import annotations

import functools
import types
import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lmstack.inference.kv_cache import StaticKVCache

if TYPE_CHECKING:
    from lmstack.inference.decode_step import DecodeStep

# Inductor options for the decode step: a C++ wrapper calls the ~200 kernels of one step instead of
# Python, and no per-call shape asserts (shapes are static). Measured on SmolLM2-135M int4, one CPU
# thread: 48 -> 62 tokens/s against the default Python wrapper.
COMPILE_OPTIONS = {"cpp_wrapper": True, "size_asserts": False}


class StaticDecoder:
    """Batch-1 generation state: a ``StaticKVCache`` plus a decode step, compiled when asked.

    ``prefill(ids)`` runs the prompt eagerly (its length varies) and returns the last logits (V,);
    ``decode(token, position)`` runs one token through the (compiled) step and returns logits (V,).
    Compiled, the step is traced once with fixed shapes (1, 1) and (1,) and guarded on them, so
    positions change without recompiling; the first ``decode`` pays the compilation (tens of
    seconds to minutes on a CPU).
    One decoder serves many prompts up to ``max_seq_len`` tokens (``reset`` between them), so the
    compilation is paid once.
    """

    def __init__(
        self,
        model,
        max_seq_len: int,
        compile: bool = False,
        dtype: torch.dtype | None = None,
        compile_mode: str | None = None,
        compile_options: dict | None = None,
        direct: bool = True,
    ):
        self.model = model
        p = next(model.parameters())
        self.device = p.device
        self.cache = StaticKVCache(model.config, 1, max_seq_len, dtype or p.dtype, p.device)
        compute = torch.float64 if p.dtype == torch.float64 else torch.float32
        for (
            rope
        ) in model.ropes():  # the compiled step reads the RoPE tables; they cannot grow inside it
            rope.reserve(max_seq_len)
            rope.tables(
                p.device, compute
            )  # built now, so the first step does not change them (a recompile)
        self.compiled = compile
        # an unembedding whose fast path at one row cannot be compiled (Int8Linear's oneDNN int8 GEMM:
        # 1.7 ms against torch's kernel's 3.7 on SmolLM2's 49152 x 576 head) runs after the graph, eagerly
        head = getattr(model, "lm_head", None)
        self._eager_head = bool(compile) and bool(getattr(head, "onednn_rows", lambda n: False)(1))
        self._step = self._forward
        self._graphs: list[
            tuple
        ] = []  # (compiled graph, its example inputs, outputs), one per Dynamo compilation
        self._direct: tuple | None = (
            None  # (graph, inputs, token slot, position slot, their shape/dtype/device) once captured
        )
        self._want_direct = compile and direct
        if compile:
            # Dynamo keeps its compiled graphs (and checks their guards on every call) per code
            # object; a copy of the code per decoder keeps each decoder's lookup to its own graph.
            code = StaticDecoder._forward.__code__.replace(co_name=f"_forward_{id(self):x}")
            forward = functools.partial(types.FunctionType(code, globals()), self)
            options = dict(COMPILE_OPTIONS) | (compile_options or {})
            if compile_mode is not None:
                from torch._inductor import list_mode_options

                try:
                    options = dict(list_mode_options(compile_mode)) | options
                except (KeyError, RuntimeError) as e:
                    raise ValueError(
                        f"compile_mode={compile_mode!r} is not a torch.compile mode ({e})"
                    ) from None
            if options.get(
                "triton.cudagraphs"
            ):  # a CUDA-graph tree is not called like a plain graph
                self._want_direct = False
            self._step = torch.compile(
                forward, fullgraph=True, dynamic=False, backend=_Inductor(self, options)
            )

    def _capture(self, token: Tensor, position: Tensor) -> None:
        """After the first compiled step: if it is one graph with one output whose inputs are this step's
        token and position plus tensors that live as long as the decoder (parameters, buffers, the cache,
        the RoPE tables), later steps call that graph directly with those tensors, without Dynamo's guard
        checks (the guards walk every parameter: a sizeable part of a small model's step; docs/inference.md)."""
        self._want_direct = False
        if len(self._graphs) != 1:
            return
        graph, inputs, n_out = self._graphs[0]
        slots = [[i for i, t in enumerate(inputs) if t is x] for x in (token, position)]
        if (
            n_out == 1
            and all(len(s) == 1 for s in slots)
            and all(isinstance(t, Tensor) for t in inputs)
        ):
            self._direct = (
                graph,
                inputs,
                slots[0][0],
                slots[1][0],
                [(t.shape, t.dtype, t.device) for t in (token, position)],
            )

    def _forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        # tokens (1, T), positions (T,) -> logits of the last token (1, V); with ``_eager_head`` its
        # final-normed hidden state (1, D), unembedded by ``decode``
        h = self.model(
            tokens, positions, kv_cache=self.cache, last_n=1, return_hidden=self._eager_head
        )
        return h[:, -1]

    def reset(self) -> None:
        self.cache.reset()

    def warm_up(self) -> None:
        """Run (and so compile) one decode step on an empty cache, then reset."""
        self.reset()
        with (
            torch.inference_mode()
        ):  # inference tensors, as every later step gets (else a guard fails: a recompile)
            zero = torch.zeros(1, dtype=torch.long, device=self.device)
            self.decode(zero.view(1, 1), zero)
        self.reset()

    @torch.inference_mode()
    def prefill(self, ids) -> Tensor:
        """The prompt from position 0, eagerly; logits of its last token (V,)."""
        return self.forward(ids, 0)[0]

    @torch.inference_mode()
    def forward(self, ids, start: int, last_n: int = 1) -> Tensor:
        """Feed ``ids`` at positions start.. eagerly (their number varies); logits of the last ``last_n`` (last_n, V)."""
        n = start + len(ids)
        if n > self.cache.max_seq_len:
            raise ValueError(
                f"{n} tokens exceed the decoder's max_seq_len={self.cache.max_seq_len}"
            )
        tokens = torch.as_tensor(list(ids), dtype=torch.long, device=self.device)[None]  # (1, T)
        # slots 0 .. n−1 hold every position so far (this decoder feeds positions in order from 0):
        # attend over those only, not over all max_seq_len slots
        self.cache.live = n
        try:
            return self.model(
                tokens,
                torch.arange(start, n, device=self.device),
                kv_cache=self.cache,
                last_n=last_n,
            )[0]
        finally:
            self.cache.live = None

    @torch.inference_mode()
    def decode(self, token: Tensor, position: Tensor) -> Tensor:
        """token: (1, 1) long; position: (1,) long, < max_seq_len (not checked: no host sync).

        Compiled with ``direct`` (the default), steps after the first skip Dynamo and its guards: they
        run the graph traced from this decoder's model as it was then, so replacing the model's modules
        or parameter tensors afterwards (in-place updates are fine) needs a new decoder, and Python-side
        effects of the forward (none in lmstack's decode path) are not replayed."""
        if (
            self._direct is not None
            and all(  # what the graph was traced for; anything else goes through Dynamo
                (t.shape, t.dtype, t.device) == sig
                for t, sig in zip((token, position), self._direct[4])
            )
        ):
            graph, inputs, i_token, i_position, _ = self._direct
            args = list(inputs)
            args[i_token], args[i_position] = token, position
            out = graph(*args)[0][
                0
            ]  # compile_fx's function takes the inputs as positional arguments
        else:
            out = self._step(token, position)[0]
            if self._want_direct:
                self._capture(token, position)
        return self.model.unembed(out) if self._eager_head else out


class _Inductor:
    """Dynamo's backend for a ``StaticDecoder``: Inductor with the decoder's options, appending (graph, the
    tensors it was traced with, number of outputs) to the decoder's ``_graphs``. Dynamo keeps its backends
    for the life of the process, so this holds the decoder only weakly (the decoder, its model and cache
    are freed with the last other reference). ``inner``: keep inductor's compiled graph and its inputs'
    shapes on the returned function, for ``inner_graph``."""

    def __init__(self, decoder: StaticDecoder | DecodeStep, options: dict, inner: bool = False):
        self.decoder, self.options, self.inner = weakref.ref(decoder), options, inner

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        inputs = list(example_inputs)  # before compile_fx, which may consume the list
        outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
        if not self.inner:
            graph = compile_fx(gm, example_inputs, config_patches=self.options)
        else:
            from torch._inductor.compile_fx import compile_fx_inner

            found: list = []

            def inner_compile(
                gm_, inputs_, **kw
            ):  # keeps inductor's compiled graph (``inner_graph``)
                out = compile_fx_inner(gm_, inputs_, **kw)
                found.append((out, [(tuple(t.shape), t.dtype) for t in inputs_]))
                return out

            # AOT's own cache would skip inner_compile (inductor's FX graph cache still answers inside it)
            with torch._functorch.config.patch(enable_autograd_cache=False):
                graph = compile_fx(
                    gm, example_inputs, inner_compile=inner_compile, config_patches=self.options
                )
            if len(found) == 1:
                graph._lmstack_inner = found[0]
        decoder = self.decoder()
        if decoder is not None:
            decoder._graphs.append(
                (graph, inputs, len(outputs) if isinstance(outputs, (list, tuple)) else 1)
            )
        return graph


def inner_graph(graph, inputs: list) -> object | None:
    """The function inside a graph ``_Inductor`` compiled that runs inductor's code (with ``cpp_wrapper``,
    the generated module's entry: it takes one list of the inputs and empties it), skipping the AOT runtime
    wrapper and ``CompiledFxGraph.__call__`` (Python around every call); None where its inputs are not
    Dynamo's (``inputs``) one for one by shape and dtype (AOT added or removed some). A caller checks its
    output against the whole graph's once before relying on it."""
    found = getattr(graph, "_lmstack_inner", None)
    if found is None:
        return None
    code, shapes = found
    want = [(tuple(t.shape), t.dtype) if isinstance(t, Tensor) else None for t in inputs]
    fn = getattr(code, "current_callable", None)
    plain = getattr(code, "_boxed_call", False) and not getattr(code, "mutated_inputs", True)
    return fn if fn is not None and plain and shapes == want else None
