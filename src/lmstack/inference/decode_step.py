"""The engine's decode-only iteration: B single-token rows over the paged cache in fixed shapes,
optionally compiled (CS336 notes "推理流程": decode is memory-bound, everything but the weight reads is
overhead; vLLM's padded decode batches with captured graphs).

A step where every scheduled sequence feeds exactly its next token (no prefill chunk, no drafts) does
not need the packed row of ``PagedKVCache.packed_batch``: row b feeds one token at position p_b and its
keys are its block table, padded with the null block to M entries, so the whole step is three tensors
(tokens (B, 1), positions (B,), table (B, M)) whatever the sequences hold.

Eagerly (``DecodeBatch``) each layer's k, v are stored in the pool first and ``attend`` reads the pool in
place through the table with lmstack's C++ paged kernel (``paged_kernel``: only each row's real blocks);
where the kernel is off (``LMSTACK_PAGED_KERNEL=torch``, a float64 model, no compiler) it reads the layer's
blocks in one indexed load of the pool and calls the model's attention implementation.

Compiled (``compile=True``), the step is compiled per *layer*, not per model (regional compilation, the
PyTorch recipe for repeated blocks): one graph of one transformer block ``Block.forward`` over a
``PagedDecodeSeam`` whose attention is ``paged_attention.decode_attention`` — keys and values read in
place through the table (the C++ kernel, a custom op in the graph, reading each row's real blocks only; or,
with the kernel off, ``paged_decode_attention``'s indirect loads fused into the score and output loops)
with this token's k, v put at its slot, returned and written into the pool once after the forward
for all layers (one ``index_copy_`` over the (L, NB·bs, K, H) pool). The block's weights are inputs of the
graph, so the L identical blocks share it: B is padded to a bucket (1, 2, 4, 8, 16, 32, 64, then multiples
of 64) and each (B, M) bucket compiles one graph (per distinct block structure), seconds instead of the
minutes a whole-model graph took. With the C++ kernel M is always max_model_len's blocks (the kernel reads
each row's real blocks only, so the padding costs nothing): one graph per batch bucket serves every length.
With the torch formula (which reads every slot) M is padded to a power of two blocks (at least 256 tokens'
worth, at most max_model_len's). ``warm_up`` compiles every (B, M) bucket, so nothing compiles while
serving. After its first call a bucket's graph is called directly with the next block's tensors (no
Dynamo guard walk per layer; checked once against Dynamo's own call on a second block). Embedding, final
norm and unembedding run eagerly (three ops). Padding rows feed token 0 at position 0 through a table of
null blocks and write into the null block, which takes padding writes by design (``block_manager``).
Inductor's FX graph cache (on by default, on disk) makes a second process's compilations much faster.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lmstack.inference import paged_kernel
from lmstack.inference.paged import PagedKVCache
from lmstack.inference.paged_attention import decode_attention
from lmstack.inference.static import COMPILE_OPTIONS, _Inductor, inner_graph
from lmstack.model.seam import AttentionImpl, AttentionMetadata
from lmstack.utils import cxx_compiler

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
COMPILE_POLICIES = ("auto", "on", "off")
# decode batches of more rows run eagerly (``DecodeStep.max_compiled_batch``): compiled wins at every batch
# measured (1.9x eager at 1 row, 1.2x at 16; docs/inference.md), so every bucket up to 64 rows compiles
MAX_COMPILED_BATCH = 64
MIN_BUCKET_TOKENS = 256  # the smallest table bucket covers this many positions


def compile_policy(compile, device: torch.device | str) -> tuple[bool | dict, str]:
    """What ``LLMEngine(compile=...)`` does: True/"on" (or a dict of inductor options) compiles the decode
    step, False/"off" runs it eagerly, "auto" compiles on a CPU whose C++ compiler inductor can use (it
    builds the kernels; ``CXX`` or g++/c++/clang++ on the PATH) and stays eager elsewhere (on CUDA the
    compiled step is untested here). -> (compile as True/False/options, the reason in words)."""
    if isinstance(compile, dict) or isinstance(compile, bool):
        return compile, "asked for" if compile is not False else "off"
    if compile not in COMPILE_POLICIES:
        raise ValueError(
            f"compile={compile!r} must be a bool, a dict of inductor options or one of {COMPILE_POLICIES}"
        )
    if compile != "auto":
        return compile == "on", compile
    if torch.device(device).type != "cpu":
        return (
            False,
            f"auto: eager on {torch.device(device).type} (compiled step tested on CPU only)",
        )
    found = cxx_compiler()
    if found is None:
        return False, "auto: eager (no C++ compiler for inductor: set CXX or install g++)"
    return True, f"auto: compiled on CPU with {found}"


def batch_bucket(n: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """The padded batch size for n decode rows: the first bucket ≥ n, then multiples of the largest."""
    for b in buckets:
        if n <= b:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


class DecodeBatch:
    """The attention seam for one eager decode-only forward: q (B, N, 1, H), k, v (B, K, 1, H) per layer.

    ``table`` (B, M) block ids, ``positions`` (B,) the fed token's position, ``slots`` (B,) its pool slot.
    ``attend`` stores this step's k, v in the pool, then (``kernel``, the default where
    ``paged_kernel.usable``) reads the layer's pool in place with the C++ paged kernel, slots 0 .. p_b of
    each row; else gathers the layer's M blocks per row through the table (B, M·bs, K, H) — the token's own
    k, v among them — and calls the model's attention implementation with key positions 0 .. M·bs−1 (mask:
    ≤ p_b, window; the layer's soft-cap passed on). ``kernel=False`` keeps the gather (the reference)."""

    def __init__(
        self,
        cache: PagedKVCache,
        table: Tensor,
        positions: Tensor,
        slots: Tensor | None = None,
        kernel: bool = True,
    ):
        self.cache, self.table, self.positions, self.slots = cache, table, positions, slots
        self.abilities = cache.abilities  # PAGED, maybe PREFIX_SHARING / QUANTISED (model.cache)
        self.kernel = kernel and not cache.stores_latent  # an MLA latent pool: its own attention

    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        meta: AttentionMetadata,
        impl: AttentionImpl,
    ) -> Tensor:
        B = k.shape[0]
        if self.slots is None:
            raise ValueError("DecodeBatch.attend needs the fed tokens' pool slots (slots=...)")
        self.cache.write(layer_idx, self.slots, k[:, :, 0], v[:, :, 0])  # in place, then read back
        c, r = self.cache, self.cache.row[layer_idx]
        if self.kernel and paged_kernel.usable(q, c.k):
            scales = (c.k_scale[r], c.v_scale[r]) if c.quant is not None else (None, None)
            return paged_kernel.paged_decode(
                q,
                c.k[r],
                c.v[r],
                self.table,
                self.positions,
                None,
                None,
                meta.window,
                meta.softcap,
                *scales,
            )  # (B, N, 1, H)
        ks = self.cache.read_blocks(layer_idx, "k", self.table, q.dtype)  # (B, S, K, H), S = M·bs
        vs = self.cache.read_blocks(layer_idx, "v", self.table, q.dtype)
        S = ks.shape[1]
        kp = torch.arange(S, device=k.device).expand(B, S)  # slot s holds position s
        m = AttentionMetadata(self.positions[:, None], kp, window=meta.window, softcap=meta.softcap)
        return impl(q, ks.transpose(1, 2), vs.transpose(1, 2), m)  # (B, N, 1, H)


class PagedDecodeSeam:
    """The attention seam of one block in the compiled decode step: q (B, N, 1, H), k, v (B, K, 1, H).

    Holds that layer's pool rows (codes and scales for a quantised pool), the table (B, M) and positions (B,);
    ``attend`` keeps this step's k, v (B, K, H) in ``k_new``/``v_new`` and returns
    ``decode_attention`` over the blocks read in place (module docstring). The layer index the model
    passes is not read: the pool rows are the layer's, so every block traces the same graph."""

    def __init__(self, k_pool, v_pool, k_scale, v_scale, table, positions, abilities):
        self.k_pool, self.v_pool, self.k_scale, self.v_scale = k_pool, v_pool, k_scale, v_scale
        self.table, self.positions, self.abilities = table, positions, abilities
        self.k_new: Tensor | None = None
        self.v_new: Tensor | None = None
        self.q: Tensor | None = None

    def attend(self, layer_idx, q, k, v, meta, impl) -> Tensor:
        self.k_new, self.v_new = k[:, :, 0], v[:, :, 0]  # (B, K, H)
        # returned by the graph too, so inductor stores q once instead of recomputing its RoPE inside the
        # attention's loops for every key slot (measured: 2.3 -> 0.6 ms a layer at 16 rows, 256 slots)
        self.q = q
        return decode_attention(
            q,
            self.k_pool,
            self.v_pool,
            self.table,
            self.positions,
            self.k_new,
            self.v_new,
            window=meta.window,
            softcap=meta.softcap,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )


def _tensors(obj, path: str, out: dict[str, Tensor], seen: set[int], depth: int = 0) -> None:
    """Every tensor reachable from a module's attributes (parameters, buffers, fused weights kept in tuples,
    RoPE tables), by attribute path: how a captured block graph finds the same input in another block."""
    if isinstance(obj, Tensor):
        out.setdefault(path, obj)
        return
    if depth > 12 or id(obj) in seen:
        return
    seen.add(id(obj))
    items: Iterable[tuple[Any, Any]]
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif isinstance(obj, torch.nn.Module) or hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        return
    for name, value in items:
        _tensors(value, f"{path}.{name}", out, seen, depth + 1)


def block_tensors(block) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    _tensors(block, "", out, set())
    return out


def block_signature(block) -> tuple:
    """Blocks with equal signatures share one graph: module types, every tensor's path, shape and dtype, and
    every scalar attribute (a per-layer window, soft-cap or flag is a constant of the traced graph) but
    ``layer_idx``, which the compiled seam does not read."""
    scalars = tuple(
        (name, k, v)
        for name, m in block.named_modules()
        for k, v in vars(m).items()
        if isinstance(v, (int, float, bool, str, type(None))) and k != "layer_idx"
    )
    tensors = tuple((p, tuple(t.shape), t.dtype) for p, t in block_tensors(block).items())
    return tuple(type(m).__name__ for m in block.modules()) + scalars + tensors


def _layer(block, x, tokens, positions, table, k_pool, v_pool, k_scale, v_scale, window, abilities):
    """One block's decode forward (the compiled region): x (B, 1, D) -> (B, 1, D), k, v (B, K, H), and q
    (B, N, 1, H), an output only so that it is stored once (``PagedDecodeSeam.attend``)."""
    seam = PagedDecodeSeam(k_pool, v_pool, k_scale, v_scale, table, positions, abilities)
    meta = AttentionMetadata(positions[:, None], window=window, cache=seam, token_ids=tokens)
    y = block(x, meta)
    return y, seam.k_new, seam.v_new, seam.q


class DecodeStep:
    """Runs decode-only iterations of ``model`` over ``cache``: ``forward(tokens, positions, tables)`` ->
    logits (R, V) of the R rows. ``compile=True`` pads to buckets and compiles one block graph per bucket
    (module docstring); ``graphs`` counts the compilations (a warm engine makes no more)."""

    def __init__(
        self,
        model,
        cache: PagedKVCache,
        max_model_len: int,
        compile: bool = False,
        compile_options: dict | None = None,
    ):
        self.model, self.cache, self.compiled = model, cache, compile
        self.buckets = (
            BATCH_BUCKETS  # batch sizes compiled (set before the first step to compile fewer)
        )
        # larger batches run eagerly (a knob: the compiled step is faster at every batch measured)
        self.max_compiled_batch = MAX_COMPILED_BATCH
        self.device = cache.k.device
        self.layers = sorted(
            cache.row, key=lambda layer: cache.row[layer]
        )  # model layers in pool-row order
        self.max_blocks = cache.blocks.blocks_for(max_model_len)
        self.min_blocks = min(self.max_blocks, cache.blocks.blocks_for(MIN_BUCKET_TOKENS))
        # the C++ kernel reads each row's real blocks only, whatever the table's width: its graphs take
        # one table of max_model_len's blocks, so a batch bucket is one graph for every length (set in
        # the compile branch below; the torch formula reads every slot and keeps the table buckets)
        self.full_table = False
        self._ranges: dict[int, Tensor] = {}  # M -> arange(M), the table fill's column index
        self.steps = self.rows = (
            0  # decode steps run and their real rows (occupancy; not warm-up's)
        )
        self.options = dict(COMPILE_OPTIONS) | (compile_options or {})
        self._steps: dict[tuple, object] = {}  # (B, M, block signature) -> compiled block
        self._direct: dict[tuple, tuple | None] = {}  # same key -> (graph, input recipe) or None
        self._templates: dict[
            tuple, tuple
        ] = {}  # (key, layer) -> the graph's inputs, per-step holes
        self._pools: list[tuple] = []  # per layer: its pool rows (``_pool``)
        self._unboxed: dict[
            tuple, object
        ] = {}  # key -> the wrapped graph (``_check_direct``'s fallback)
        self._plans: dict[tuple, list] = {}  # (B, M) -> the warm loop's calls (``_plan``)
        self._graphs: list[
            tuple
        ] = []  # filled by the _Inductor backend: (graph, example inputs, number of outputs)
        if compile:
            blocks = list(getattr(model, "blocks", ()))
            if getattr(model, "embed", None) is None or getattr(model, "norm", None) is None:
                raise ValueError(
                    "compile=True: the compiled decode step needs a whole Transformer (embed, "
                    "blocks, norm); got a model without an embedding or final norm"
                )
            if [self.cache.row.get(i) for i in range(len(blocks))] != list(range(len(blocks))):
                raise ValueError(
                    "compile=True: the compiled decode step needs every layer's K/V in the pool"
                )
            paged_kernel.selected()  # built (or refused) before tracing: the graph reads the choice
            p = next(model.parameters())
            with torch.no_grad():  # q's dtype is the embedding's (the kernel takes fp32/bf16/fp16)
                x = model.embed(torch.zeros(1, 1, dtype=torch.long, device=p.device))
            self.full_table = not cache.stores_latent and paged_kernel.usable(x, cache.k)
            compute = torch.float64 if p.dtype == torch.float64 else torch.float32
            for rope in (
                model.ropes()
            ):  # the compiled step reads the RoPE tables; they cannot grow inside it
                rope.reserve(max_model_len)
                rope.tables(p.device, compute)
            # after the RoPE tables exist: a layer's own RoPE (Gemma-3's global layers) is its tensor
            self.blocks = blocks
            # each distinct signature as a small int: a graph key is hashed per layer per step, and
            # hashing the signature tuple itself cost ~0.5 ms a step (30 layers, two lookups each)
            ids: dict[tuple, int] = {}
            self._signatures = [ids.setdefault(block_signature(b), len(ids)) for b in blocks]
            self._block_tensors = [block_tensors(b) for b in blocks]

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def table_bucket(self, m: int) -> int:
        """Padded table width for m blocks: ``max_blocks`` where the kernel reads the table
        (``full_table``), else a power of two ≥ ``min_blocks``, at most ``max_blocks``."""
        if self.full_table and m <= self.max_blocks:
            return self.max_blocks
        b = self.min_blocks
        while b < m:
            b *= 2
        return min(b, self.max_blocks) if m <= self.max_blocks else m

    def _eager(self, tokens: Tensor, positions: Tensor, table: Tensor, slots: Tensor) -> Tensor:
        batch = DecodeBatch(self.cache, table, positions, slots)
        return self.model(tokens, positions[:, None], kv_cache=batch, last_n=1)[:, -1]  # (B, V)

    def _compiled_block(self, key: tuple):
        if key not in self._steps:
            # one code object per (bucket, block structure): each keeps its own single graph in Dynamo's cache
            code = _layer.__code__.replace(co_name=f"_decode_layer_{len(self._steps)}_{id(self):x}")
            self._steps[key] = torch.compile(
                types.FunctionType(code, globals()),
                fullgraph=True,
                dynamic=False,
                backend=_Inductor(self, self.options, inner=True),
            )
        return self._steps[key]

    def _pool(self, i: int) -> tuple:
        """Layer i's pool rows (K codes, V codes, K scales, V scales or None): views made once."""
        if not self._pools:
            c, q = self.cache, self.cache.quant is not None
            self._pools = [
                (c.k[r], c.v[r], c.k_scale[r] if q else None, c.v_scale[r] if q else None)
                for r in range(len(self.blocks))
            ]
        return self._pools[i]

    def _capture(self, key: tuple, i: int, args: tuple) -> None:
        """The graph just compiled for block i: record where each of its inputs comes from (one of the
        step's tensors x, tokens, positions, table; the layer's pool rows; a tensor of the block by
        attribute path; or a constant shared by all blocks)."""
        graph, inputs, _ = self._graphs[-1]
        by_id = {id(t): p for p, t in self._block_tensors[i].items()}
        recipe: list[tuple[str, Any]] = []
        for t in inputs:
            j = next((j for j, a in enumerate(args) if a is t), None)
            if j is not None:
                recipe.append(("arg", j))
            elif id(t) in by_id:
                recipe.append(("block", by_id[id(t)]))
            elif isinstance(t, Tensor):
                recipe.append(("const", t))
            else:
                self._direct[key] = None  # a symbolic or non-tensor input: keep Dynamo's call
                return
        # inductor's own entry where its inputs are Dynamo's (called with one list: no AOT runtime wrapper,
        # no CompiledFxGraph.__call__), else the function under Dynamo's disable wrapper (no eval-frame
        # switch per call: we are not tracing); ``_check_direct`` falls back from the first to the second
        inner = inner_graph(graph, inputs)
        wrapped = getattr(graph, "__wrapped__", graph)
        self._direct[key] = (inner, recipe, True) if inner is not None else (wrapped, recipe, False)
        self._unboxed[key] = wrapped

    def _template(self, key: tuple, i: int) -> tuple[list, list[tuple[int, int]]]:
        """Block i's inputs of the captured graph with the per-step ones (x, tokens, positions, table)
        left as holes: (inputs, [(input index, argument index)]), built once per (bucket, block)."""
        t = self._templates.get((key, i))
        if t is None:
            _, recipe, _ = self._direct[key]  # type: ignore[misc]
            static = (None,) * 4 + self._pool(i)
            tensors = self._block_tensors[i]
            inputs = [
                static[r] if kind == "arg" else tensors[r] if kind == "block" else r
                for kind, r in recipe
            ]
            holes = [(n, r) for n, (kind, r) in enumerate(recipe) if kind == "arg" and r < 4]
            t = self._templates[(key, i)] = (inputs, holes)
        return t

    def _direct_call(self, key: tuple, i: int, step: tuple) -> tuple:
        fn, _, boxed = self._direct[key]  # type: ignore[misc]
        inputs, holes = self._template(key, i)
        args = list(inputs)
        for n, r in holes:
            args[n] = step[r]
        return fn(args) if boxed else fn(*args)

    def _run_block(self, i: int, B: int, M: int, x, tokens, positions, table):
        key = (B, M, self._signatures[i])
        direct = self._direct.get(key, False)
        if direct:
            return self._direct_call(key, i, (x, tokens, positions, table))
        args = (x, tokens, positions, table, *self._pool(i))
        fn = self._compiled_block(key)
        window, abilities = self.model.config.sliding_window, self.cache.abilities
        n_before = len(self._graphs)
        out = fn(self.blocks[i], *args, window, abilities)
        if direct is False and len(self._graphs) == n_before + 1 and self._graphs[-1][2] == 4:
            self._capture(key, i, args)
            self._check_direct(key, i + 1, x, tokens, positions, table)
        elif direct is False:
            self._direct[key] = None
        return out

    def _check_direct(self, key: tuple, j: int, x, tokens, positions, table) -> None:
        """Call block j (the next one of this structure) both ways once: the direct call must give
        Dynamo's result exactly (else inductor's entry gives way to the wrapped graph, and that to
        Dynamo's guarded call)."""
        nxt = next((n for n in range(j, len(self.blocks)) if self._signatures[n] == key[2]), None)
        if not self._direct.get(key) or nxt is None:
            return
        j = nxt
        fn = self._compiled_block(key)
        args = (x, tokens, positions, table, *self._pool(j))
        ref = fn(self.blocks[j], *args, self.model.config.sliding_window, self.cache.abilities)
        while self._direct[key]:
            try:
                got = self._direct_call(key, j, (x, tokens, positions, table))
            except Exception:  # noqa: BLE001 — a way of calling it that does not work: the next one
                got = ()
            if len(ref) == len(got) and all(map(torch.equal, ref, got)):
                return
            _, recipe, boxed = self._direct[key]  # type: ignore[misc]
            self._direct[key] = (self._unboxed[key], recipe, False) if boxed else None

    def _plan(self, B: int, M: int) -> list | None:
        """Once every block's graph of bucket (B, M) is called directly: per block (function, its inputs
        with holes, the holes, called with one list?), so a step's loop does no lookups."""
        plan = self._plans.get((B, M))
        if plan is None:
            keys = [(B, M, sig) for sig in self._signatures]
            if not all(self._direct.get(key) for key in keys):
                return None
            plan = self._plans[(B, M)] = [
                (self._direct[key][0], *self._template(key, i), self._direct[key][2])  # type: ignore[index]
                for i, key in enumerate(keys)
            ]
        return plan

    def _compiled(self, tokens: Tensor, positions: Tensor, table: Tensor):
        """tokens (B, 1), positions (B,), table (B, M) -> logits (B, V), new k, v (L, B, K, H) each."""
        model = self.model
        B, M = table.shape
        x = model.embed(tokens)  # (B, 1, D)
        if model.config.embed_scale:  # Gemma: W_e[tokens]·√D, as Transformer.forward
            x = x * torch.tensor(model.config.d_model**0.5, dtype=x.dtype)
        ks, vs = [], []
        plan = self._plan(B, M)
        if plan is not None:  # the warm path: each block's graph called directly, nothing looked up
            for fn, inputs, holes, boxed in plan:
                args = list(inputs)
                step = (x, tokens, positions, table)
                for n, r in holes:
                    args[n] = step[r]
                x, k, v, _ = fn(args) if boxed else fn(*args)
                ks.append(k)
                vs.append(v)
        else:
            for i in range(len(self.blocks)):
                x, k, v, _ = self._run_block(i, B, M, x, tokens, positions, table)
                ks.append(k)
                vs.append(v)
        logits = model.unembed(model.norm(x))[:, -1]  # (B, V)
        return logits, torch.stack(ks), torch.stack(vs)

    @torch.inference_mode()
    def forward(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> Tensor:
        """R rows: the token each feeds, its position, its block table (up to the block of that position)
        -> logits (R, V). Stores every layer's K/V of the fed tokens in the pool."""
        R = len(tokens)
        self.steps += 1
        self.rows += R
        lens = [len(t) for t in tables]
        m = max(lens)
        compiled = self.compiled and R <= self.max_compiled_batch
        B, M = (batch_bucket(R, self.buckets), self.table_bucket(m)) if compiled else (R, m)
        bs, pad = self.cache.block_size, [0] * (B - R)
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        long, dev = torch.long, self.device
        # (B, 1); pads: token 0 at position 0
        tok = torch.tensor(tokens + pad, dtype=long, device=dev)[:, None]
        pos = torch.tensor(positions + pad, dtype=long, device=dev)  # (B,)
        # one more host->tensor copy: slots (B,), each row's length, then every row's blocks; the table's
        # null-block padding is filled by torch, so Python work grows with the real blocks, not with M
        flat = torch.tensor(
            slots + pad + lens + [b for t in tables for b in t], dtype=long, device=dev
        )
        table = torch.zeros(B, M, dtype=long, device=dev)  # (B, M)
        if min(lens) == M:
            table[:R] = flat[B + R :].view(R, M)
        else:
            cols = self._ranges.get(M)
            if cols is None:
                cols = self._ranges[M] = torch.arange(M, device=self.device)
            table[:R][cols < flat[B : B + R, None]] = flat[B + R :]
        slots_t = flat[:B]  # (B,) pads -> the null block's slot 0
        if not compiled:
            return self._eager(tok, pos, table, slots_t)
        logits, k, v = self._compiled(tok, pos, table)
        self.cache.write_layers(self.layers, slots_t, k, v)
        return logits[:R]

    def table_buckets(self) -> list[int]:
        """Every table width a step up to max_model_len uses: ``max_blocks`` alone with ``full_table``."""
        out = [self.table_bucket(1)]
        while out[-1] < self.max_blocks:
            out.append(self.table_bucket(out[-1] + 1))
        return out

    def warm_up(self, batch_sizes) -> None:
        """Compile the buckets of these batch sizes at every table bucket (``table_buckets``) on
        null-block rows, so that no sequence's growth compiles a graph while serving."""
        counted = self.steps, self.rows  # warm-up steps are not the occupancy's
        for b in sorted({batch_bucket(n, self.buckets) for n in batch_sizes}):
            if b <= self.max_compiled_batch:
                for M in self.table_buckets():
                    self.forward([0] * b, [0] * b, [[0] * M] * b)
        self.steps, self.rows = counted
