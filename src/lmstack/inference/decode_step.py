"""The engine's decode-only iteration: B single-token rows over the paged cache in fixed shapes,
optionally compiled once per bucket (CS336 notes "推理流程": decode is memory-bound, everything but the
weight reads is overhead; vLLM's padded decode batches with captured graphs).

A step where every scheduled sequence feeds exactly its next token (no prefill chunk, no drafts) does
not need the packed row of ``PagedKVCache.packed_batch``: row b feeds one token at position p_b and its
keys are its block table, padded with the null block to M entries, so the whole step is three tensors
(tokens (B, 1), positions (B,), table (B, M)) whatever the sequences hold. ``DecodeBatch.attend`` reads
each layer's blocks through the table in one indexed load of the pool (no per-sequence Python, no slot
lists that grow with the blocks). Eagerly each layer's k, v are stored in the pool first and come back
with the blocks; compiled, the step puts them at the row's own position of the loaded copy and keeps
them, and the cache is written once after the forward for all layers (one ``index_copy_`` over the
(L, NB·bs, K, H) pool), so the graph only reads the pool and mutates none of its inputs. Key slot s of row b holds position s; the mask (s ≤ p_b, and the sliding window) hides the slots
past the token, the padding and released blocks.

``DecodeStep`` runs it eagerly, or compiled (``compile=True``): B is padded to a bucket (1, 2, 4, 8, 16,
32, 64, then multiples of 64) and M to a power of two blocks (at least 256 tokens' worth, at most
max_model_len's), each (B, M) bucket traced once by ``torch.compile(fullgraph=True, dynamic=False)``
with the static decoder's inductor options, and — as ``StaticDecoder`` does — called directly after its
first step (no Dynamo guard walk). Padding rows feed token 0 at position 0 through a table of null
blocks and write into the null block, which takes padding writes by design (``block_manager``).
"""

from __future__ import annotations

import functools
import types
from typing import cast

import torch
from torch import Tensor

from lmstack.inference.paged import PagedKVCache
from lmstack.inference.static import COMPILE_OPTIONS, _Inductor
from lmstack.model.seam import AttentionImpl, AttentionMetadata

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_BUCKET_TOKENS = 256  # the smallest table bucket covers this many positions


def batch_bucket(n: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """The padded batch size for n decode rows: the first bucket ≥ n, then multiples of the largest."""
    for b in buckets:
        if n <= b:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


class DecodeBatch:
    """The attention seam for one decode-only forward: q (B, N, 1, H), k, v (B, K, 1, H) per layer.

    ``table`` (B, M) block ids, ``positions`` (B,) the fed token's position. ``attend`` gathers the layer's
    M blocks per row through the table, (B, M·bs, K, H), sets slot p_b to this step's k, v, and calls the
    model's attention implementation with key positions 0 .. M·bs−1 (mask: ≤ p_b, window). The k, v of
    every layer are kept in ``new_k``/``new_v`` for ``DecodeStep`` to store after the forward. Eagerly
    (``slots`` (B,) given) each layer's k, v are stored in the pool first and read back with the blocks:
    one copy of the blocks instead of a copy and the copy that puts the token into it."""

    def __init__(
        self, cache: PagedKVCache, table: Tensor, positions: Tensor, slots: Tensor | None = None
    ):
        self.cache, self.table, self.positions, self.slots = cache, table, positions, slots
        self.new_k: list[Tensor] = []
        self.new_v: list[Tensor] = []
        self.abilities = cache.abilities  # PAGED, maybe PREFIX_SHARING / QUANTISED (model.cache)

    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        meta: AttentionMetadata,
        impl: AttentionImpl,
    ) -> Tensor:
        B, K, _, H = k.shape
        if (
            self.slots is not None
        ):  # eager: store first (in place), then read the blocks with this token in them
            self.cache.write(layer_idx, self.slots, k[:, :, 0], v[:, :, 0])
        ks = self.cache.read_blocks(layer_idx, "k", self.table, q.dtype)  # (B, S, K, H), S = M·bs
        vs = self.cache.read_blocks(layer_idx, "v", self.table, q.dtype)
        if (
            self.slots is None
        ):  # compiled: the pool is only read; this token goes into the copy, the pool after
            rows = torch.arange(B, device=k.device)
            ks = ks.index_put(
                (rows, self.positions), k[:, :, 0].to(ks.dtype)
            )  # this token at its own slot
            vs = vs.index_put((rows, self.positions), v[:, :, 0].to(vs.dtype))
            self.new_k.append(k[:, :, 0])  # (B, K, H)
            self.new_v.append(v[:, :, 0])
        S = ks.shape[1]
        kp = torch.arange(S, device=k.device).expand(B, S)  # slot s holds position s
        m = AttentionMetadata(self.positions[:, None], kp, window=meta.window)
        return impl(q, ks.transpose(1, 2), vs.transpose(1, 2), m)  # (B, N, 1, H)


class DecodeStep:
    """Runs decode-only iterations of ``model`` over ``cache``: ``forward(tokens, positions, tables)`` ->
    logits (R, V) of the R rows. ``compile=True`` pads to buckets and compiles each once (module docstring);
    ``graphs`` counts the compilations (a warm engine makes no more)."""

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
        self.device = cache.k.device
        self.layers = sorted(
            cache.row, key=lambda layer: cache.row[layer]
        )  # model layers in pool-row order
        self.max_blocks = cache.blocks.blocks_for(max_model_len)
        self.min_blocks = min(self.max_blocks, cache.blocks.blocks_for(MIN_BUCKET_TOKENS))
        self.options = dict(COMPILE_OPTIONS) | (compile_options or {})
        self._steps: dict[tuple[int, int], object] = {}  # (B, M) -> compiled step
        self._direct: dict[
            tuple[int, int], tuple
        ] = {}  # (B, M) -> (graph, inputs, token/position/table slots)
        self._graphs: list[
            tuple
        ] = []  # filled by the _Inductor backend: (graph, example inputs, number of outputs)
        if compile:
            p = next(model.parameters())
            compute = torch.float64 if p.dtype == torch.float64 else torch.float32
            for rope in (
                model.ropes()
            ):  # the compiled step reads the RoPE tables; they cannot grow inside it
                rope.reserve(max_model_len)
                rope.tables(p.device, compute)

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def table_bucket(self, m: int) -> int:
        """Padded table width for m blocks: a power of two ≥ ``min_blocks``, at most ``max_blocks``."""
        b = self.min_blocks
        while b < m:
            b *= 2
        return min(b, self.max_blocks) if m <= self.max_blocks else m

    def _forward(self, tokens: Tensor, positions: Tensor, table: Tensor):
        """tokens (B, 1), positions (B,), table (B, M) -> logits (B, V), new k, v (L, B, K, H) each."""
        batch = DecodeBatch(self.cache, table, positions)
        logits = self.model(tokens, positions[:, None], kv_cache=batch, last_n=1)[:, -1]  # (B, V)
        return logits, torch.stack(batch.new_k), torch.stack(batch.new_v)

    def _eager(self, tokens: Tensor, positions: Tensor, table: Tensor, slots: Tensor) -> Tensor:
        batch = DecodeBatch(self.cache, table, positions, slots)
        return self.model(tokens, positions[:, None], kv_cache=batch, last_n=1)[:, -1]  # (B, V)

    def _step_for(self, key: tuple[int, int]):
        if key not in self._steps:
            # one code object per bucket: each keeps its own single graph in Dynamo's cache
            code = DecodeStep._forward.__code__.replace(
                co_name=f"_decode_{key[0]}x{key[1]}_{id(self):x}"
            )
            fn = functools.partial(types.FunctionType(code, globals()), self)
            self._steps[key] = torch.compile(
                fn, fullgraph=True, dynamic=False, backend=_Inductor(self, self.options)
            )
        return self._steps[key]

    def _call(self, tokens: Tensor, positions: Tensor, table: Tensor):
        key = cast("tuple[int, int]", tuple(table.shape))  # (B, M)
        direct = self._direct.get(key)
        if direct is not None:
            graph, inputs, slots = direct
            args = list(inputs)
            for i, t in zip(slots, (tokens, positions, table)):
                args[i] = t
            return graph(*args)  # compile_fx's function takes the inputs as positional arguments
        n_before = len(self._graphs)
        out = self._step_for(key)(tokens, positions, table)
        if len(self._graphs) == n_before + 1:  # just compiled: capture its graph for direct calls
            graph, inputs, n_out = self._graphs[-1]
            slots = [
                [i for i, t in enumerate(inputs) if t is x] for x in (tokens, positions, table)
            ]
            if (
                n_out == 3
                and all(len(s) == 1 for s in slots)
                and all(isinstance(t, Tensor) for t in inputs)
            ):
                self._direct[key] = (graph, inputs, [s[0] for s in slots])
        return out

    @torch.inference_mode()
    def forward(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> Tensor:
        """R rows: the token each feeds, its position, its block table (up to the block of that position)
        -> logits (R, V). Stores every layer's K/V of the fed tokens in the pool."""
        R = len(tokens)
        m = max(map(len, tables))
        B, M = (batch_bucket(R, self.buckets), self.table_bucket(m)) if self.compiled else (R, m)
        rows = [t + [0] * (M - len(t)) for t in tables] + [[0] * M] * (B - R)  # null block pads
        table = torch.tensor(rows, dtype=torch.long, device=self.device)  # (B, M)
        pos = torch.tensor(positions + [0] * (B - R), dtype=torch.long, device=self.device)  # (B,)
        tok = torch.tensor(tokens + [0] * (B - R), dtype=torch.long, device=self.device)[
            :, None
        ]  # (B, 1)
        bs = self.cache.block_size
        slots = (
            table[torch.arange(B, device=self.device), pos // bs] * bs + pos % bs
        )  # (B,) pads -> null block
        if not self.compiled:
            return self._eager(tok, pos, table, slots)
        logits, k, v = self._call(tok, pos, table)
        self.cache.write_layers(self.layers, slots, k, v)
        return logits[:R]

    def warm_up(self, batch_sizes, blocks: int = 1) -> None:
        """Compile the buckets of these batch sizes (table bucket of ``blocks`` blocks) on null-block rows."""
        for b in sorted({batch_bucket(n, self.buckets) for n in batch_sizes}):
            self.forward([0] * b, [0] * b, [[0] * blocks] * b)
