"""int4 weight-only quantisation, asymmetric, one (scale, minimum) per group of G inputs (CS336 notes "量化").

For each output row o and group j of G consecutive inputs:  s = (max − min) / 15,
Q = round((W − min) / s) ∈ [0, 15],  Ŵ = Q · s + min,  so |W − Ŵ| ≤ s / 2.
CPU kernels: lmstack's own in ``int4_vnni`` (int8 activations per group of G; AVX-512 VNNI, or AVX2 without
it; used when the CPU and a compiler allow, see that module) and torch's ``_weight_int4pack_mm_for_cpu``, which
uses the form Ŵ = (Q − 8) · s + z with the zero point z = min + 8 s, and takes (scale, z) packed as (I/G, O, 2).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.cpu import cpu_features
from lmstack.quant import int4_vnni
from lmstack.quant.linear import WeightOnlyLinear, best_seconds_pair, env_terms, gemm_rows

QMAX4 = 15
TERMS_ENV = "LMSTACK_INT4_TERMS"
GEMM_ENV = "LMSTACK_INT4_GEMM"  # "dequant": the old prefill path (gemm_forward_dequant)
_log = logging.getLogger(__name__)
_logged: set[str] = set()


def quantize_int4(weight: Tensor, group_size: int = 32) -> tuple[Tensor, Tensor, Tensor]:
    """W (O, I) -> (Q (O, I) uint8 in [0, 15], scales (O, I/G) fp32, minimums (O, I/G) fp32)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    O, I = weight.shape
    if group_size <= 0 or I % group_size:
        raise ValueError(f"in_features={I} is not a multiple of group_size={group_size}")
    w = weight.detach().float().view(O, I // group_size, group_size)  # (O, I/G, G)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # (O, I/G)
    scale = (hi - lo) / QMAX4
    scale = torch.where(
        scale > 0, scale, torch.ones_like(scale)
    )  # a constant group: Q = 0, Ŵ = min
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, QMAX4).to(torch.uint8)
    return q.view(O, I), scale, lo


def dequantize_int4(
    q: Tensor, scale: Tensor, lo: Tensor, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Ŵ = Q · s + min per group, shape (O, I)."""
    O, I = q.shape
    G = I // scale.shape[1]
    w = q.float().view(O, -1, G) * scale[..., None] + lo[..., None]
    return w.view(O, I).to(dtype)


def gemm_dtype() -> torch.dtype:
    """The dtype of a prefill's dequantise + GEMM: bf16 where the CPU multiplies it natively (AMX or AVX512_BF16:
    oneDNN's bf16 GEMM, 2-4x the fp32 one at 100-row prefills on SmolLM2-135M's matrices, docs/log/quant.md),
    else float32 (without native bf16 torch emulates it, slower than fp32). ``lmstack.cpu.cpu_features()``."""
    return torch.bfloat16 if cpu_features().native_bf16 else torch.float32


def gemm_forward(
    x: Tensor, packed: Tensor, d: Tensor, m: Tensor, G: int, kernel: str, dtype: torch.dtype
) -> Tensor:
    """x (M, I) -> (M, O) float32 as ``Int4Linear`` computes a prefill: the weights dequantised in C++ to
    ``dtype`` (W = d·q + m, rounded to bf16 when ``dtype`` is bf16) one block of output rows at a time into a
    buffer that stays in L2, each block multiplied with x in that dtype right after, fp32 accumulation and
    output (``int4_vnni.gemm``: oneDNN's brgemm for bf16, ATen's mm for fp32). ``LMSTACK_INT4_GEMM=dequant``
    takes the old path instead (``gemm_forward_dequant``)."""
    if os.environ.get(GEMM_ENV, "").strip().lower() == "dequant":
        return gemm_forward_dequant(x, packed, d, m, G, kernel, dtype)
    return int4_vnni.gemm(x, packed, d, m, G, kernel=kernel, dtype=dtype)


def gemm_forward_dequant(
    x: Tensor, packed: Tensor, d: Tensor, m: Tensor, G: int, kernel: str, dtype: torch.dtype
) -> Tensor:
    """The reference for ``gemm_forward``: the whole (O, I) weight dequantised to ``dtype`` in one pass
    (``int4_vnni.dequant``), then ``F.linear`` in that dtype (oneDNN; a bf16 output) and a cast to float32.
    Writes and reads O·I·2 (bf16) or 4 (fp32) bytes more than the tiled op."""
    w = int4_vnni.dequant(packed, d, m, G, kernel=kernel, dtype=dtype)
    return F.linear(x.to(dtype), w).float()


def measure_gemm_rows(
    kernel: str,
    O: int = 1024,
    I: int = 576,
    G: int = 32,
    dtype: torch.dtype = torch.float32,
    terms: int = 1,
):
    """``measure(M) -> (s of lmstack's int4 ``kernel`` with ``terms`` int8 terms, s of ``gemm_forward`` in
    ``dtype``)`` on random (M, I) activations and a random (O, I) weight (an ``Int4Linear`` passes its own shape
    and terms): ``gemm_rows``'s measurement, one thread count as set now."""
    g = torch.Generator().manual_seed(0)
    packed, d, m = int4_vnni.pack(*quantize_int4(torch.randn(O, I, generator=g), G))

    def measure(M: int) -> tuple[float, float]:
        x = torch.randn(M, I, generator=g)
        with torch.inference_mode():
            return best_seconds_pair(
                lambda: int4_vnni.mm(x, packed, d, m, G, terms, kernel=kernel),
                lambda: gemm_forward(x, packed, d, m, G, kernel, dtype),
            )

    return measure


def default_terms(kernel: str) -> int:
    """Int8 terms per activation for ``kernel`` when ``Int4Linear(terms=None)``: 1 on every kernel (llama.cpp's
    Q4_1 x Q8_1 precision; SmolLM2 perplexity +0.9-1.1% over two terms, docs/quant.md). Both kernels are
    bound by their integer dot products from a few rows on (one AVX-512 ``vpdpbusd`` per cycle; AVX2's
    ``vpmaddubsw`` + ``vpmaddwd``), so the second term costs 1.7-1.9x from 4 rows and 1.25-1.35x at one
    (SmolLM2's shapes, one thread, docs/quant.md): the engine's 16-row decode step took 42 vs 34.5 ms, the
    batch-1 step 8.6 vs 7.7 ms. ``LMSTACK_INT4_TERMS=2`` takes the ~15-bit pair. (``kernel`` is kept for
    a per-kernel choice; today all give 1.)"""
    return env_terms(TERMS_ENV, 1)


def _has_int4_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


class Int4Linear(WeightOnlyLinear):
    """y = x Ŵᵀ (+ b) with Ŵ stored as packed 4-bit Q and per-group (scale, zero) — 0.5 byte per weight.

    ``compute_dtype`` as in ``Int8Linear`` (bf16: the CPU kernel's fast path). ``terms``: int8 terms per
    activation in lmstack's kernels (2: ~15 bits; 1: one Q8 term, llama.cpp's Q4_1 x Q8_1 precision, +1.1%
    SmolLM2 perplexity, about half the integer work); None (the default): ``default_terms(kernel)``, 1 unless
    ``LMSTACK_INT4_TERMS=2``. ``kernel``: "auto"
    takes lmstack's kernel the CPU runs (``int4_vnni.kernel()``: "vnni" or "avx2"; int8 activations per
    group, fp16 d and m) when ``compute_dtype`` is bf16, else torch's (bf16 activations); "aten" forces
    torch's, "vnni" / "avx2" that one of ours (a ValueError with the reason if it cannot run). The one
    chosen is ``self.kernel``. Without a kernel (or when O is not a multiple of 16) the codes are packed two
    per byte by hand and the forward dequantises. With one of ours, from ``self.gemm_rows`` activation rows on
    (a prefill, or a step with many decode rows) the forward dequantises the packed codes in C++
    (``int4_vnni.dequant``: W = d·q + m with the kernel's fp16 d, m) and runs ``F.linear`` in ``self.gemm_dtype``
    (``gemm_forward``: bf16 where the CPU has native bf16, oneDNN's AMX GEMM, else float32): the row count is
    measured once per process for each kernel, GEMM dtype and weight shape (``linear.gemm_rows``; a fused layer
    measures its own shape; ``LMSTACK_QUANT_GEMM_ROWS=N|never`` forces it), None = never.
    """

    def __init__(
        self,
        q: Tensor,
        scale: Tensor,
        lo: Tensor,
        bias: Tensor | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        kernel: str = "auto",
        terms: int | None = None,
    ):
        O, I = q.shape
        if terms not in (None, 1, 2):
            raise ValueError(
                f"terms={terms!r}; expected 1 or 2 int8 terms per activation (or None)"
            )
        super().__init__(O, I, bias, compute_dtype)
        if kernel not in ("auto", "aten", *int4_vnni.KERNELS):
            raise ValueError(
                f"kernel={kernel!r}; expected 'auto', 'aten', {', '.join(map(repr, int4_vnni.KERNELS))}"
            )
        self.group_size = I // scale.shape[1]
        self.register_buffer("scale", scale.float().contiguous())  # (O, I/G)
        self.register_buffer("lo", lo.float().contiguous())  # (O, I/G)
        shape_ok = O % 16 == 0 and I % 8 == 0 and self.group_size % 8 == 0
        if kernel in int4_vnni.KERNELS:  # forced: it runs or the constructor says why not
            why = int4_vnni.build(kernel) or (
                None if shape_ok else f"shape ({O}, {I}), G={self.group_size}"
            )
            if why:
                raise ValueError(f"kernel={kernel!r} cannot run: {why}")
            self.kernel = kernel
        else:
            ours = kernel == "auto" and compute_dtype == torch.bfloat16 and shape_ok
            self.kernel = int4_vnni.kernel() if ours else "aten"
        # lmstack's kernels: int8 terms per activation (1: llama.cpp's Q8_1 precision)
        self.terms = default_terms(self.kernel) if terms is None else terms
        if self.vnni:
            self.use_kernel, self.fallback_reason = True, None
            packed, d, m = int4_vnni.pack(q, scale, lo)
            self.register_buffer("qweight", packed)  # (O/16, I/8, 64) uint8, two codes per byte
            self.register_buffer("d16", d)  # (O/16, I/G, 16) fp16
            self.register_buffer("m16", m)
            self.gemm_dtype = gemm_dtype()
            self._measure_gemm_rows()
            return
        self.gemm_rows = None
        self.use_kernel = (
            _has_int4_kernel() and O % 16 == 0
        )  # the CPU packing needs O divisible by 16
        self.fallback_reason = (
            None
            if self.use_kernel
            else (
                "torch has no _weight_int4pack_mm_for_cpu kernel"
                if not _has_int4_kernel()
                else f"out_features={O} is not a multiple of 16 (the CPU int4 packing needs it)"
            )
        )
        if not self.use_kernel:
            self.kernel = "dequant"
        if self.fallback_reason and self.fallback_reason not in _logged:  # once per reason
            _logged.add(self.fallback_reason)
            _log.warning(
                "Int4Linear: %s; this layer dequantises and runs F.linear (same numbers, no speed-up)",
                self.fallback_reason,
            )
        if self.use_kernel:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q.to(torch.int32).contiguous(), 1
            )
            self.register_buffer("qweight", packed)  # (O, I/2) uint8, two 4-bit values per byte
            zero = lo + 8 * scale  # Ŵ = (Q − 8)·s + z
            sz = torch.stack([scale.t(), zero.t()], dim=-1)  # (I/G, O, 2)
            self.register_buffer("scales_and_zeros", sz.to(compute_dtype).contiguous())
        else:
            self.register_buffer(
                "qweight", (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
            )  # (O, I/2)

    def _measure_gemm_rows(self) -> None:
        """``gemm_rows`` for this layer's shape, kernel, int8 terms and GEMM dtype (measured once per process for
        each; the kernel with the layer's own terms: two cost 1.7-1.9x one, which had moved the hand-over to 16
        rows where one term ties with the GEMM)."""
        O, I, dt = self.out_features, self.in_features, self.gemm_dtype
        key = f"int4_{self.kernel}_t{self.terms}_{str(dt).removeprefix('torch.')}_{O}x{I}"
        self.gemm_rows = gemm_rows(
            key, measure_gemm_rows(self.kernel, O, I, self.group_size, dt, self.terms)
        )

    def _measure_for_shape(self) -> None:
        if self.vnni:  # one of lmstack's kernels: the GEMM's row count depends on the shape
            self._measure_gemm_rows()

    @classmethod
    def from_linear(
        cls, linear: nn.Module, group_size: int = 32, compute_dtype: torch.dtype = torch.bfloat16
    ) -> Int4Linear:
        return cls(
            *quantize_int4(linear.weight, group_size), getattr(linear, "bias", None), compute_dtype
        )

    @classmethod
    def from_weight(
        cls, weight: Tensor, group_size: int = 32, compute_dtype: torch.dtype = torch.bfloat16
    ) -> Int4Linear:
        return cls(*quantize_int4(weight, group_size), None, compute_dtype)

    @property
    def vnni(self) -> bool:
        """Whether lmstack's own int8-activation kernel (``kernel`` "vnni" or its AVX2 twin "avx2") runs this layer."""
        return self.kernel in int4_vnni.KERNELS

    def _codes(self) -> Tensor:
        """Q (O, I) from the stored form (the kernel's packed layout is opaque: recover it by
        multiplying the identity, which is exact for 4-bit codes)."""
        if self.vnni:
            return int4_vnni.unpack(self.qweight)
        if not self.use_kernel:
            lo, hi = self.qweight & 0xF, self.qweight >> 4
            return torch.stack([lo, hi], dim=-1).view(self.out_features, self.in_features)
        eye = torch.eye(self.in_features, dtype=torch.float32)
        ones = torch.stack(
            [torch.ones_like(self.scale.t()), torch.full_like(self.scale.t(), 8.0)], -1
        )
        codes = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.qweight, self.group_size, ones
        )  # (I, O)
        return torch.round(codes.t()).to(torch.uint8)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_int4(self._codes(), self.scale, self.lo, dtype)

    def kernel_bytes(self) -> int:
        """Bytes the matmul reads: packed Q (half a byte per weight) and each group's scale and zero."""
        if self.vnni:
            return self.qweight.numel() + 2 * self.d16.numel() * self.d16.element_size()
        sz = self.scales_and_zeros if self.use_kernel else torch.stack([self.scale, self.lo])
        return self.qweight.numel() + sz.numel() * sz.element_size()

    def forward(self, x: Tensor) -> Tensor:  # (..., I) -> (..., O)
        if (
            self.vnni and x.device.type == "cpu"
        ):  # fp32 or bf16 x straight in: the kernel quantises it to int8
            x2 = x.reshape(-1, self.in_features)  # (M, I)
            if (
                self.gemm_rows is not None and x2.shape[0] >= self.gemm_rows
            ):  # a prefill: float GEMM (bf16 on a CPU with native bf16)
                y = gemm_forward(
                    x2,
                    self.qweight,
                    self.d16,
                    self.m16,
                    self.group_size,
                    self.kernel,
                    self.gemm_dtype,
                )
            else:
                y = int4_vnni.mm(
                    x2, self.qweight, self.d16, self.m16, self.group_size, self.terms, self.kernel
                )
            y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.vnni:  # off the CPU: dequantise
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        return super().forward(x)

    def _rows_first(self) -> bool:  # torch's packing keeps (scale, zero) as (I/G, O, 2): not joined
        return self.vnni or not self.use_kernel

    def _kernel_ok(self) -> bool:
        return self.use_kernel

    def _kernel_mm(self, x2: Tensor) -> Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.qweight, self.group_size, self.scales_and_zeros
        )  # (M, O)

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f", group_size={self.group_size}, kernel={self.kernel}, terms={self.terms}"
        )
