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
PyTorch recipe for repeated blocks; ``regional.BlockGraphs``, which the batch-1 ``StaticDecoder`` shares): one graph of one transformer block ``Block.forward`` over a
``PagedDecodeSeam`` whose attention is ``paged_attention.decode_attention`` — keys and values read in
place through the table (the C++ kernel, a custom op in the graph, reading each row's real blocks only; or,
with the kernel off, ``paged_decode_attention``'s indirect loads fused into the score and output loops)
with this token's k, v put at its slot, returned and written into the pool once after the forward
for all layers (one ``index_copy_`` over the (L, NB·bs, K, H) pool). The block's weights are inputs of the
graph, so the L identical blocks share it: B is padded to a bucket (1, 2, 4, 6, 8, 12, 16, 24, 32, 48,
64, then multiples of 64) and each (B, M) bucket compiles one graph (per distinct block structure), seconds
instead of the minutes a whole-model graph took. With the C++ kernel M is always max_model_len's blocks (the kernel reads
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

import torch
from torch import Tensor

from lmstack.inference import paged_kernel
from lmstack.inference.paged import PagedKVCache
from lmstack.inference.regional import COMPILE_OPTIONS, BlockGraphs, reserve_rope_tables
from lmstack.model.seam import AttentionImpl, AttentionMetadata
from lmstack.utils import cxx_compiler

# a padded row costs about what a real one does on a CPU (its share of every matmul: SmolLM2 int4, one thread
# of an AVX-512 Xeon, ~1 ms a row from 8 rows on), so the buckets are closer than powers of two: 11 rows in the
# 12 bucket took 20.3 ms a step against 24.6 in the 16 bucket (docs/inference.md)
BATCH_BUCKETS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
COMPILE_POLICIES = ("auto", "on", "off")
# decode batches of more rows run eagerly (``DecodeStep.max_compiled_batch``): compiled wins at every batch
# measured (1.9x eager at 1 row, 1.2x at 16; docs/log/inference.md), so every bucket up to 64 rows compiles
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
        self._pools: list[tuple] = []  # per layer: its pool rows (``_pool``)
        self.regional: BlockGraphs | None = None  # the compiled blocks (``regional.BlockGraphs``)
        if compile:
            n_layers = len(getattr(model, "blocks", ()))
            reserve_rope_tables(
                model, max_model_len
            )  # before BlockGraphs reads the blocks' tensors
            # (checks the model is a whole Transformer, and chooses the paged kernel before tracing)
            self.regional = BlockGraphs(model, self._pool, cache.abilities, self.options)
            if [self.cache.row.get(i) for i in range(n_layers)] != list(range(n_layers)):
                raise ValueError(
                    "compile=True: the compiled decode step needs every layer's K/V in the pool"
                )
            p = next(model.parameters())
            with torch.no_grad():  # q's dtype is the embedding's (the kernel takes fp32/bf16/fp16)
                x = model.embed(torch.zeros(1, 1, dtype=torch.long, device=p.device))
            self.full_table = not cache.stores_latent and paged_kernel.usable(x, cache.k)

    @property
    def graphs(self) -> int:
        return self.regional.graphs if self.regional is not None else 0

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

    def _pool(self, i: int) -> tuple:
        """Layer i's pool rows (K codes, V codes, K scales, V scales or None): views made once."""
        if not self._pools:
            c, q = self.cache, self.cache.quant is not None
            self._pools = [
                (c.k[r], c.v[r], c.k_scale[r] if q else None, c.v_scale[r] if q else None)
                for r in range(len(self.model.blocks))
            ]
        return self._pools[i]

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
        assert self.regional is not None  # compiled
        logits, k, v = self.regional.forward(tok, pos, table)
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
