"""The GEMM under every lmstack ``Linear``: oneDNN or torch's BLAS (MKL), chosen per CPU; the experts' grouped GEMMs.

CS336 notes "优化技巧" (pick the kernel by measurement), "工程细节 / 基准测试". On a CPU, torch's ``F.linear`` in fp32
runs its BLAS (MKL in the PyPI wheels); oneDNN's GEMM (``torch.ops.mkldnn._linear_pointwise``, on the same plain
strided tensors, forward and both backward products in ``_OneDNNLinear``) is the other implementation. Which is
faster depends on the CPU (docs/kernels.md, "The CPU GEMM"): MKL takes a slow path on AMD, where oneDNN measured
~2x faster from 8 rows up; on this project's Intel Xeon MKL is faster at every row count up to 128 on SmolLM2's
576↔1536 weights and level beyond, and only the unembedding-sized weight (V·D ≥ 4M elements) gains from oneDNN,
1.2-1.9x from 4 rows (at 1-2 rows MKL is 10-25% faster).

A ``GemmPolicy`` says when a product goes to oneDNN: from ``min_rows`` rows, or for a weight of ``min_weight``
elements from ``min_weight_rows`` rows, or, with autograd off (inference), for a row count in ``infer_rows``
(None: never by that rule). An inference product through oneDNN runs on the weight reordered once into oneDNN's
blocked layout (``packed_weight``, where the policy's ``prepack`` says so): the plain-strided call handles the
weight's layout on every call, which at decode row counts costs as much as the product (Intel Xeon, 30 layers of
SmolLM2-135M's fused weights, 1 thread: MKL / packed oneDNN 1.5x at 4 rows, 1.7x at 8, 1.3x at 16-32, 1.08x
at 64, level from 256, 0.95x at 512+: docs/kernels.md). The packed copy costs the weight's size again in
memory and is rebuilt when the weight changes (its ``_version``: an optimizer step or ``load_state_dict``
writes in place — GRPO's rollout engine shares the learner's weights). ``choose_gemm(name, features)`` turns ``auto``
into the measured row of ``MEASURED`` for the CPU's vendor (``lmstack.cpu``: ``LMSTACK_CPU=<name>`` fakes one) — a table, not a
per-process measurement, because oneDNN and MKL round differently and a choice that flipped between runs would
make them differ in the last bits; ``benchmarks/gemm_dispatch.py`` measures a CPU for a new row. ``onednn``
sends every eligible product to oneDNN, ``blas`` none (``LMSTACK_ONEDNN=0`` makes ``auto`` mean ``blas``).
``kernels.runtime.configure`` sets the policy (``set_gemm``); until then the first call picks ``auto``.

``inference_dtype(torch.bfloat16)`` (GRPO's ``rollout_dtype="bf16"``: the engine's rollouts, never the learner)
runs fp32 inference products as bf16 GEMMs on a packed bf16 copy of each fp32 weight (in place of the fp32
packed copy: half its memory), the result back in fp32 so norms, attention and sampling stay fp32.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.cpu import CpuFeatures, cpu_features

try:  # private: if a torch release moves it, treat every call as "a dispatch mode is active" (plain F.linear)
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # pragma: no cover - depends on the torch version

    def _get_current_dispatch_mode():
        return True


GEMM_BACKENDS = ("auto", "onednn", "blas")
#: oneDNN is built into this torch and has the fused linear op (read once: nothing a compiled graph must trace)
_MKLDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)


@dataclass(frozen=True)
class GemmPolicy:
    """oneDNN for a product of ≥ ``min_rows`` rows, or with a weight of ≥ ``min_weight`` elements and ≥
    ``min_weight_rows`` rows, or with autograd off and a row count in ``infer_rows`` = [lo, hi) (None: never
    by that rule);
    ``prepack``: inference products through oneDNN use ``packed_weight``; ``prepack_bf16``: so do bf16 inference
    products, at any row count; ``name`` the backend, ``reason`` why (the log line)."""

    name: str
    min_rows: int | None
    min_weight: int | None
    min_weight_rows: int = 1
    reason: str = ""
    infer_rows: tuple[int, int] | None = None
    prepack: bool = False
    prepack_bf16: bool = False

    def uses_onednn(self, rows: int, weight_numel: int, inference: bool = False) -> bool:
        return (
            (self.min_rows is not None and rows >= self.min_rows)
            or (
                self.min_weight is not None
                and weight_numel >= self.min_weight
                and rows >= self.min_weight_rows
            )
            or (
                inference
                and self.infer_rows is not None
                and self.infer_rows[0] <= rows < self.infer_rows[1]
            )
        )

    def line(self) -> str:
        return f"gemm: {self.name} ({self.reason})"


@dataclass(frozen=True)
class Measured:
    """A ``MEASURED`` row: ``GemmPolicy``'s thresholds for one vendor and where they were measured."""

    min_rows: int | None
    min_weight: int | None
    min_weight_rows: int
    infer_rows: tuple[int, int] | None
    prepack: bool
    prepack_bf16: bool  # on a CPU with AMX bf16 (where it was measured)
    why: str


#: vendor -> its measured thresholds; docs/kernels.md has the figures
MEASURED: dict[str, Measured] = {
    # AMD EPYC (AVX2), SmolLM2 shapes, 2 threads: oneDNN 1.9-2.4x from 8 rows, 1.3x / 0.86x at one row
    # (plain-strided oneDNN; its prepacked weights were not measured there)
    "AuthenticAMD": Measured(
        8, 1 << 22, 1, None, False, False, "AMD EPYC: oneDNN from 8 rows or a weight of 4M elements"
    ),
    # Intel Xeon (AVX-512 + AMX), 1 thread, benchmarks/gemm_dispatch.py: MKL / plain oneDNN 0.17-0.97 at 1-128
    # rows on 576<->1536 weights, 0.89-1.13 at 512-2048; on the 49152x576 unembedding 0.89 / 0.75 at 1 / 2 rows,
    # 1.23-1.97 at 4-64, 1.1 at 128, level at 512. MKL / prepacked oneDNN (inference; 30 layers of SmolLM2's
    # fused q+k+v, o, gate+up, down weights, each read once as in a forward): 0.95 / 1.02 at 2 / 3 rows, 1.50
    # at 4, 1.68 at 8, 1.27 at 16-32, 1.08 at 64-128, 1.04 at 256, 0.94-0.96 at 512-1024
    "GenuineIntel": Measured(
        None,
        1 << 22,
        4,
        (4, 512),
        True,
        True,
        "Intel Xeon: MKL; oneDNN for a weight of 4M elements from 4 rows, and for inference products of "
        "4-511 rows, on prepacked weights",
    ),
}
ONEDNN_ALWAYS = GemmPolicy("onednn", 1, 0, 1, "configured", prepack=True, prepack_bf16=True)
BLAS_ONLY = GemmPolicy("blas", None, None, 1, "configured")


def choose_gemm(name: str = "auto", features: CpuFeatures | None = None) -> GemmPolicy:
    """The policy for backend ``name``: ``onednn``, ``blas``, or ``auto`` = the ``MEASURED`` row of the CPU's vendor
    (a vendor not measured: ``blas``, torch's own choice). ``LMSTACK_ONEDNN=0`` turns ``auto`` into ``blas``;
    ``LMSTACK_PREPACK=0`` keeps ``auto`` but without prepacked weights (and so without the inference rows, which
    only pay on packed weights): no second copy of the weights in memory."""
    if name not in GEMM_BACKENDS:
        raise ValueError(f"gemm backend={name!r}; expected one of {GEMM_BACKENDS}")
    if name == "onednn":
        return ONEDNN_ALWAYS
    if name == "blas":
        return BLAS_ONLY
    if os.environ.get("LMSTACK_ONEDNN", "1") == "0":
        return GemmPolicy("blas", None, None, 1, "auto: LMSTACK_ONEDNN=0")
    f = features if features is not None else cpu_features()
    if f.vendor not in MEASURED:
        return GemmPolicy(
            "blas", None, None, 1, f"auto: vendor {f.vendor or 'unknown'!r} not measured"
        )
    m = MEASURED[f.vendor]
    if (
        os.environ.get("LMSTACK_PREPACK", "1") == "0"
    ):  # no packed copies (memory): the plain-strided rules only
        return GemmPolicy(
            "auto", m.min_rows, m.min_weight, m.min_weight_rows, f"auto: {m.why}; LMSTACK_PREPACK=0"
        )
    return GemmPolicy(
        "auto",
        m.min_rows,
        m.min_weight,
        m.min_weight_rows,
        f"auto: {m.why}",
        m.infer_rows,
        m.prepack,
        m.prepack_bf16 and f.has("amx_bf16"),
    )


_POLICY: list[GemmPolicy | None] = [
    None
]  # the one in use; None = choose ``auto`` at the first call


def gemm_policy() -> GemmPolicy:
    """The policy in use (``auto`` for this CPU until ``set_gemm`` is called)."""
    p = _POLICY[0]
    if p is None:
        p = _POLICY[0] = choose_gemm("auto")
    return p


def set_gemm(policy: GemmPolicy | None) -> GemmPolicy | None:
    """Use ``policy`` from now on (None: ``auto`` again at the next call); returns the previous one. Called by
    ``kernels.runtime.configure``; tests and benchmarks restore what it returns."""
    old, _POLICY[0] = _POLICY[0], policy
    return old


_INFERENCE_DTYPE: list[torch.dtype | None] = [None]  # None: fp32 inference products stay fp32


@contextmanager
def inference_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Inside: fp32 inference products (autograd off) of ``linear`` compute in ``dtype`` (bf16, or None/fp32 for
    fp32) on a packed copy of the weight in that dtype, their outputs cast back to fp32 — the low-precision rollout
    of verl/OpenRLHF (a bf16 sampler beside an fp32 learner). Process-wide while the block runs: the caller's
    own forwards (``GRPOTrainer.rollout`` around ``LLM.generate``, which steps the engine in this thread)."""
    if dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"inference_dtype={dtype}; expected torch.bfloat16, torch.float32 or None")
    old, _INFERENCE_DTYPE[0] = _INFERENCE_DTYPE[0], None if dtype is torch.float32 else dtype
    try:
        yield
    finally:
        _INFERENCE_DTYPE[0] = old


class _OneDNNLinear(torch.autograd.Function):
    """x (n, D_in) @ w (D_out, D_in)ᵀ through oneDNN, forward and both backward products."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return _onednn_mm_t(x, w)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        dx = _onednn_mm_t(dy, w.t()) if ctx.needs_input_grad[0] else None  # dy @ w
        dw = _onednn_mm_t(dy.t(), x.t()) if ctx.needs_input_grad[1] else None  # dyᵀ @ x
        return dx, dw


def _onednn_mm_t(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """a @ bᵀ (+ bias) by oneDNN (any strides; b plain or ``packed_weight``'s)."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


def onednn_linear(x: Tensor, w: Tensor) -> Tensor:
    """x (n, D_in) @ w (D_out, D_in)ᵀ through oneDNN, differentiable in both (callers check ``onednn_ok``)."""
    return _OneDNNLinear.apply(x, w)


def onednn_ok(x: Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a matmul on x may go through oneDNN: CPU ``dtype`` (fp32; bf16 for ``linear``'s packed path) eager (no tracing or counting dispatch mode active,
    so FLOP counters and compilers see plain ``mm``; no CPU autocast, under which F.linear computes in bf16),
    oneDNN built in, and a plain tensor (a DTensor of the native parallel backend has no oneDNN sharding rule).
    Whether it *does* is the policy's (``gemm_policy``)."""
    # is_compiling() first: Dynamo cannot trace torch.backends.mkldnn.is_available (`generate --compile` at
    # fp32 would raise torch._dynamo.exc.Unsupported), and a compiled graph wants plain mm anyway
    return (
        not torch.compiler.is_compiling()
        and type(x) is Tensor
        and x.device.type == "cpu"
        and x.dtype == dtype
        and _MKLDNN_LINEAR
        and _get_current_dispatch_mode() is None
        and not torch.is_autocast_enabled("cpu")
    )


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, views: Sequence[Tensor] = ()
) -> Tensor:
    """``F.linear``, through oneDNN's GEMM where ``onednn_ok`` and the policy sends a product of this many rows
    and this weight there; with autograd off, on the prepacked weight and in row buckets — fp32 by the policy's
    rows, bf16 at any row count where ``prepack_bf16`` (F.linear's bf16 GEMM is oneDNN's on such a CPU, with the
    weight re-laid out at every call: the packed call gives the same bits). x (..., in) -> (..., out).
    ``views``: parameters whose ``.data`` is a part of ``weight`` (``model.layers.fuse_linears``): an in-place
    write to one of them does not move ``weight``'s version counter, so their versions key the packed copy too."""
    if type(weight) in (Tensor, nn.Parameter) and weight.dtype == x.dtype:
        inference = not torch.is_grad_enabled()
        rows = x.numel() // max(x.shape[-1], 1)
        if weight.dtype == torch.float32 and onednn_ok(x):
            if inference and _INFERENCE_DTYPE[0] is torch.bfloat16:
                return _bf16_inference_linear(x, weight, bias, views)
            policy = gemm_policy()
            if policy.uses_onednn(rows, weight.numel(), inference):
                if inference:
                    return _inference_linear(x, weight, bias, views, policy.prepack)
                y = onednn_linear(x.reshape(-1, x.shape[-1]), weight)
                y = y.view(*x.shape[:-1], weight.shape[0])
                return y if bias is None else y + bias
        elif (
            inference
            and weight.dtype == torch.bfloat16
            and gemm_policy().prepack_bf16
            and onednn_ok(x, torch.bfloat16)
            and (bias is None or bias.dtype == torch.bfloat16)
        ):
            return _inference_linear(x, weight, bias, views, True)
    return F.linear(x, weight, bias)


def _inference_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, views: Sequence[Tensor], prepack: bool
) -> Tensor:
    """x (..., in) @ weightᵀ (+ bias) by oneDNN with autograd off: rows padded to their bucket, on the packed
    weight if ``prepack`` (packed in x's dtype: an fp32 weight's bf16 copy for a bf16 x)."""
    x2 = x.reshape(-1, x.shape[-1])  # (rows, in)
    rows = x2.shape[0]
    padded = bucket_rows(rows)
    if padded != rows:  # zero rows up to the bucket: their outputs are dropped below
        x2 = F.pad(x2, (0, 0, 0, padded - rows))
    w = packed_weight(weight, views, x.dtype) if prepack else weight
    return _onednn_mm_t(x2, w, bias)[:rows].view(*x.shape[:-1], weight.shape[0])


def _bf16_inference_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, views: Sequence[Tensor]
) -> Tensor:
    """x (..., in) fp32 @ weightᵀ fp32 as a bf16 GEMM (fp32 accumulation inside oneDNN), output (..., out) fp32:
    on the packed bf16 copy of weight where the policy prepacks bf16 (a CPU with AMX), else ``F.linear`` on a
    bf16 cast (a CPU without native bf16 emulates it: slow, which ``rollout_dtype="auto"`` avoids)."""
    xb = x.to(torch.bfloat16)
    if gemm_policy().prepack_bf16 and x.numel():
        y = _inference_linear(xb, weight, None, views, True)
    else:
        y = F.linear(xb, weight.to(torch.bfloat16))
    y = y.float()
    return y if bias is None else y + bias


# the batch size oneDNN's weight layout is chosen for (one layout served 1-2048 rows alike)
PACK_ROWS = 64
#: id(weight) -> (weak reference to it, its key when packed, the packed copy); an entry leaves with its weight
_PACKED: dict[int, tuple[weakref.ref, tuple, Tensor]] = {}


def _version(t: Tensor) -> int | None:
    """t's version counter (in-place writes move it); None for an inference tensor, which has none."""
    return None if t.is_inference() else t._version


def packed_weight(
    w: Tensor, views: Sequence[Tensor] = (), dtype: torch.dtype | None = None
) -> Tensor:
    """w (O, I) (cast to ``dtype`` first, if given: the bf16 rollout's copy of an fp32 weight) reordered into
    oneDNN's blocked layout for ``_linear_pointwise`` (an opaque mkldnn tensor), made at the first call and kept while w lives and is unchanged: rebuilt when w is written in place (its
    ``_version``, which views share with their base: an optimizer step on the separate q/k/v parameters
    reaches a weight they view) or its storage is swapped (``data_ptr``); ``views``' versions count too (see
    ``linear``). An inference tensor has no version counter: it is keyed by its storage alone (int8's prepacked
    Q does the same). One copy per weight: a request in another dtype replaces it."""
    dtype = w.dtype if dtype is None else dtype
    key = (w.data_ptr(), tuple(w.shape), w.stride(), dtype, *map(_version, (w, *views)))
    hit = _PACKED.get(id(w))
    if hit is not None and hit[0]() is w and hit[1] == key:
        return hit[2]
    if hit is not None:  # drop the stale copy first (peak memory: one copy, not two)
        del _PACKED[id(w)]
        hit = None
    packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().to(dtype), PACK_ROWS)
    wid = id(w)

    def forget(ref: weakref.ref, wid: int = wid) -> None:
        if _PACKED.get(wid, (None,))[0] is ref:
            del _PACKED[wid]

    _PACKED[wid] = (weakref.ref(w, forget), key, packed)
    return packed


ROW_BUCKET = 32  # inference products of more rows are padded to a multiple of this


def bucket_rows(rows: int, bucket: int = ROW_BUCKET) -> int:
    """The row count an inference product through oneDNN runs with: ``rows`` up to ``bucket``, else the next
    multiple of ``bucket``. oneDNN caches one primitive per shape (up to its cache capacity, 1,024): a server's
    prefills of every length would each add one, and its memory grew with every new length (docs/serving.md,
    "Memory under load"); buckets bound the shapes at a cost of at most bucket - 1 zero rows."""
    return rows if rows <= bucket else -(-rows // bucket) * bucket


def expert_swiglu(x: Tensor, counts: list[int], gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """Grouped SwiGLU of the MoE experts (``model.moe``): x (R, D) rows sorted by expert, counts[e] rows for
    expert e; weights gate/up (E, F, D), down (E, D, F) -> (R, D). ``torch._grouped_mm`` on CUDA bf16; else one
    ``linear`` per weight per expert (oneDNN or BLAS by the policy, per expert's rows)."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and x.shape[0]:
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x, gate.transpose(1, 2), offs=offs)) * torch._grouped_mm(
            x, up.transpose(1, 2), offs=offs
        )  # (R, F)
        return torch._grouped_mm(h, down.transpose(1, 2), offs=offs)  # (R, D)
    outs = []
    plain = type(gate) in (Tensor, nn.Parameter)
    mm = linear if plain else F.linear
    # unbind once: its backward stacks the E per-expert grads in one op (indexing gate[e] per expert would
    # materialise a zero (E, F, D) grad per expert and add them up)
    gates, ups, downs = gate.unbind(0), up.unbind(0), down.unbind(0)
    for e, rows in enumerate(x.split(counts)):  # a loop over the E experts; each one (n_e, D) block
        if rows.shape[0]:
            outs.append(mm(F.silu(mm(rows, gates[e])) * mm(rows, ups[e]), downs[e]))
    if not outs:
        # no rows for any expert here: still a (0, D) result *in the graph* of x and the weights, so the
        # backward reaches x (with expert parallelism the all-to-all that produced x must run its backward
        # collective on every rank, or the ranks deadlock/abort)
        rows = x[:0]  # F.linear: oneDNN has no primitive for an empty product's backward
        return F.linear(F.silu(F.linear(rows, gates[0])) * F.linear(rows, ups[0]), downs[0])
    return torch.cat(outs)
