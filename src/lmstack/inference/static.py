"""The fast batch-1 decode path: a static KV cache and a decode step compiled once.

Book of LLMs §2.4 (KV cache), CS336 notes "推理流程" (decode is one token per step and memory-bound:
the weights are read once per token, everything else is overhead). ``StaticKVCache`` has fixed
shapes (B, K, S_max, H) per layer and writes with ``index_copy_`` at tensor positions, so a decode
step never reads a value back to the host and never changes shape; ``torch.compile`` can then
turn the whole step (30 layers of norms, RoPE, attention, SwiGLU) into one graph of fused
kernels with no Python per op. Empty slots carry position −1 and the model's mask hides them.
The cache itself lives with the others in ``inference.kv_cache``.

Compiled, the step is compiled *regionally* by default (``regional.BlockGraphs``, the engine's decode
step's machinery): the cache is laid out as a paged pool (``StaticKVCache(block_size=16)``, one fixed
table), one graph of ``group`` consecutive transformer blocks (5 by default) — their attention lmstack's C++
paged kernel over slots 0 .. p only, not all S_max — is shared by every group of the same structure and
called directly after its first call; embedding, final norm and unembedding run eagerly, and the step's k, v of every layer are stored
after the blocks in one ``index_copy_``. ``regional=False`` keeps the whole model's step as one graph (the
cache in its (B, K, S, H) layout, attention over all S_max slots, masked): minutes to compile on a CPU
against seconds, and no faster per token (on the Zen 3 the regional step decoded 1.08–1.18× its tokens per
CPU-second; docs/inference.md).
"""

from __future__ import annotations

import functools
import types

import torch
from torch import Tensor

from lmstack.inference.kv_cache import StaticKVCache
from lmstack.inference.regional import (
    COMPILE_OPTIONS,
    BlockGraphs,
    _Inductor,
    reserve_rope_tables,
)

# the static cache's block size in the pool layout of the regional step (the paged kernel's tiles are 16 slots)
BLOCK_SIZE = 16


class StaticDecoder:
    """Batch-1 generation state: a ``StaticKVCache`` plus a decode step, compiled when asked.

    ``prefill(ids)`` runs the prompt eagerly (its length varies) and returns the last logits (V,);
    ``decode(token, position)`` runs one token through the (compiled) step and returns logits (V,).
    Compiled, the step has fixed shapes (1, 1) and (1,), so positions change without recompiling; the
    first ``decode`` pays the compilation (seconds per distinct block structure regionally, the default;
    minutes for ``regional=False``'s whole-model graph, traced and guarded on those shapes).
    ``regional`` falls back to the whole-model graph where a model is not a whole Transformer (no
    embedding or final norm) or ``compile_mode`` asks for CUDA graphs.
    One decoder serves many prompts up to ``max_seq_len`` tokens (``reset`` between them), so the
    compilation is paid once. ``fuse_projections`` (default) fuses the model's q/k/v and gate/up first,
    as ``LLMEngine`` does (measured at one thread of an AVX-512 Xeon, SmolLM2-135M int4 compiled: 117 -> 133
    tokens/s with lmstack's AVX2 kernels, 151 -> 168 with VNNI; docs/quant.md). ``group``: blocks per graph of
    the regional step (``BlockGraphs``): 5 makes SmolLM2's 30 layers 6 calls a step instead of 30, 3 % less CPU
    time a token on the Xeon (5.62 -> 5.45 ms with the AVX2 kernels, 5.85 -> 5.65 with VNNI; each call costs
    ~10 µs of Python and handle conversion there, more on a slower core) for ~2 s more of a cold compile; 30,
    one graph, took 64 s to compile against 7 s for one block.
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
        regional: bool = True,
        fuse_projections: bool = True,
        group: int = 5,
    ):
        self.model = model
        if fuse_projections and hasattr(model, "fuse_projections"):
            # q/k/v and gate/up as one GEMM each, as the engine (``Transformer.fuse_projections``: the
            # model is changed in place, its weights become views): 4 quantised matmuls a layer instead
            # of 7, one activation quantisation for each fused one
            model.fuse_projections()
        p = next(model.parameters())
        self.device = p.device
        self.compiled = compile
        options = dict(COMPILE_OPTIONS) | (compile_options or {})
        if compile_mode is not None:
            from torch._inductor import list_mode_options

            try:
                options = dict(list_mode_options(compile_mode)) | options
            except (KeyError, RuntimeError) as e:
                raise ValueError(
                    f"compile_mode={compile_mode!r} is not a torch.compile mode ({e})"
                ) from None
        cudagraphs = bool(
            options.get("triton.cudagraphs")
        )  # a CUDA-graph tree is not called like a plain graph
        whole = (
            getattr(model, "embed", None) is not None and getattr(model, "norm", None) is not None
        )
        self.regional: BlockGraphs | None = None
        regional = bool(compile) and regional and whole and not cudagraphs
        self.cache = StaticKVCache(
            model.config,
            1,
            max_seq_len,
            dtype or p.dtype,
            p.device,
            block_size=BLOCK_SIZE if regional else None,
        )
        # the compiled step reads the RoPE tables; they cannot grow inside it (built now, also eagerly)
        reserve_rope_tables(model, max_seq_len)
        self._step = self._forward
        self._eager_head = False
        self._graphs: list[
            tuple
        ] = []  # (compiled graph, its example inputs, outputs), one per Dynamo compilation
        self._direct: tuple | None = (
            None  # (graph, inputs, token slot, position slot, their shape/dtype/device) once captured
        )
        self._want_direct = compile and direct and not cudagraphs
        if regional:
            cache = self.cache
            pools = [(*cache.pool(i), None, None) for i in range(len(cache.k))]
            self.regional = BlockGraphs(
                model, pools.__getitem__, cache.abilities, options, direct=direct, group=group
            )
        elif compile:
            # an unembedding whose fast path at one row cannot be compiled (Int8Linear's oneDNN int8 GEMM:
            # 1.7 ms against torch's kernel's 3.7 on SmolLM2's 49152 x 576 head) runs after the graph, eagerly
            head = getattr(model, "lm_head", None)
            self._eager_head = bool(getattr(head, "onednn_rows", lambda n: False)(1))
            # Dynamo keeps its compiled graphs (and checks their guards on every call) per code
            # object; a copy of the code per decoder keeps each decoder's lookup to its own graph.
            code = StaticDecoder._forward.__code__.replace(co_name=f"_forward_{id(self):x}")
            forward = functools.partial(types.FunctionType(code, globals()), self)
            self._step = torch.compile(
                forward, fullgraph=True, dynamic=False, backend=_Inductor(self, options)
            )

    @property
    def graphs(self) -> int:
        """Graphs compiled so far: one per distinct block structure regionally, one for the whole model."""
        return self.regional.graphs if self.regional is not None else len(self._graphs)

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
        run the graphs traced from this decoder's model as it was then, so replacing the model's modules
        or parameter tensors afterwards (in-place updates are fine) needs a new decoder, and Python-side
        effects of the forward (none in lmstack's decode path) are not replayed. Regionally, other
        integer dtypes are taken as long and other shapes are refused."""
        if self.regional is not None:
            if token.shape != (1, 1) or position.shape != (1,):
                raise ValueError(
                    f"decode takes token (1, 1) and position (1,), got {tuple(token.shape)} and "
                    f"{tuple(position.shape)}"
                )
            token, position = token.to(torch.long), position.to(torch.long)  # no copy when long
            logits, k, v = self.regional.forward(token, position, self.cache.table)
            self.cache.store(position, k, v)  # (L, 1, K, H) each, at slot ``position``
            return logits[0]
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
