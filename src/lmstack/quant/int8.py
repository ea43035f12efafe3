"""int8 weight-only quantisation, symmetric, one scale per output channel (CS336 notes "量化").

For W of shape (O, I):  s_o = max_i |W_oi| / 127,  Q_oi = round(W_oi / s_o) ∈ [-127, 127],
Ŵ_oi = s_o · Q_oi, so |W_oi − Ŵ_oi| ≤ s_o / 2. The matmul y = x Ŵᵀ = (x Qᵀ) ⊙ s is what
``torch.ops.aten._weight_int8pack_mm`` computes on CPU without materialising Ŵ. On an AVX2 CPU without
AVX-512 VNNI torch's kernel is slow (measured 2-10x behind lmstack's at batch 1, docs/quant.md), so there
``Int8Linear`` runs lmstack's ``csrc/int8_avx2.cpp`` instead: int8 activations per group of G inputs (one int8
term by default, llama.cpp's Q8_0 × Q8_0 precision; two, ~15 bits, with ``terms=2`` or ``LMSTACK_INT8_TERMS=2``),
y_o = s_o · Σ_g Σ_t s_x,t,g · Σ_{i∈g} Q_oi · x_q,t,i.
Where torch's kernel runs (an AVX-512 VNNI CPU), from ``gemm_rows`` activation rows on (measured per weight
shape: one row for the 49152 x 576 unembedding, more for small weights) ``Int8Linear`` runs oneDNN's int8
GEMM (AMX / VNNI) on Q prepacked once: two int8 terms per activation row (``onednn_mm``),
y_m,o = s_o · Σ_t s_x,t,m · Σ_i Q_oi · x_q,t,m,i.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.cpu import cpu_features, probe
from lmstack.quant import int4_vnni
from lmstack.quant.linear import WeightOnlyLinear, best_seconds_pair, env_terms, gemm_rows

QMAX8 = 127
ENV = "LMSTACK_INT8_KERNEL"
TERMS_ENV = "LMSTACK_INT8_TERMS"


def default_terms() -> int:
    """Int8 terms per activation in lmstack's AVX2 int8 kernel when ``Int8Linear(terms=None)``: 1 (llama.cpp's
    Q8_0 x Q8_0 precision, as the int4 kernels' default), unless ``LMSTACK_INT8_TERMS=2`` (~15 bits). On SmolLM2's
    49152 x 576 unembedding (the int8 layer a served GGUF model has) at 16 rows one term takes 7.4 ms against two
    terms' 14.2 (AVX2 build, one thread; 1.1 ms either way at one row), for +0.15 % perplexity (docs/quant.md).
    The oneDNN path keeps its two per-row terms (``onednn_mm``: one term per *row* is much coarser than one per
    group of 32)."""
    return env_terms(TERMS_ENV, 1)


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """W (O, I) float -> (Q (O, I) int8, s (O,) fp32) with W ≈ s[:, None] · Q."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / QMAX8  # (O,)
    scale = torch.where(
        scale > 0, scale, torch.ones_like(scale)
    )  # an all-zero row: any scale works
    q = torch.round(w / scale[:, None]).clamp(-QMAX8, QMAX8).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Ŵ = s[:, None] · Q, shape (O, I)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def _has_int8_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def choose_int8_kernel(flags, arch: str, forced: str = "") -> tuple[str, str | None]:
    """Int8Linear's kernel for a CPU with ISA ``flags`` and ``arch``: ("avx2", None) where the int4 choice is
    the AVX2 kernel (AVX2 without AVX-512 VNNI: torch's int8 kernel is slow there), else ("aten", why).
    ``forced``: the ``LMSTACK_INT8_KERNEL`` value ("avx2" runs ours on any AVX2 CPU, "aten" torch's)."""
    forced = (forced or "auto").strip().lower()
    if forced not in ("auto", "aten", "avx2"):
        raise ValueError(f"{ENV}={forced!r}; expected one of auto, aten, avx2")
    if forced == "aten":
        return "aten", f"{ENV}=aten"
    name, why = int4_vnni.choose_kernel(flags, arch, "avx2" if forced == "avx2" else "")
    if name == "avx2":
        return "avx2", None
    return "aten", why or "torch's int8 kernel is as fast on an AVX-512 VNNI CPU"


def int8_kernel() -> str:
    """The kernel Int8Linear's "auto" takes on this CPU: "avx2" (lmstack's, built) or "aten"."""
    cpu = cpu_features()
    name, _ = choose_int8_kernel(cpu.flags, cpu.arch, os.environ.get(ENV, ""))
    return name if name == "aten" or int4_vnni.build("int8_avx2") is None else "aten"


def measure_gemm_rows(O: int = 1024, I: int = 576, terms: int = 1):
    """``measure(M) -> (s of lmstack's AVX2 int8 kernel with ``terms``, s of dequantise + F.linear)`` on an
    (O, I) weight: ``linear.gemm_rows``'s measurement for ``Int8Linear(kernel="avx2")``."""
    g = torch.Generator().manual_seed(0)
    q, s = quantize_int8(torch.randn(O, I, generator=g))
    packed, G = pack_int8(q), next(g_ for g_ in (32, 16, 8) if I % g_ == 0)

    def measure(M: int) -> tuple[float, float]:
        x = torch.randn(M, I, generator=g)
        with torch.inference_mode():
            k, f = best_seconds_pair(
                lambda: torch.ops.lmstack_quant.int8_avx2_mm(x, packed, s, G, terms),
                lambda: F.linear(x, dequantize_int8(unpack_int8(packed), s)),
            )
        return k, f

    return measure


# CPU flags with which oneDNN's u8 x s8 GEMM sums exactly: without VNNI / AMX (an AVX2 CPU) it multiplies with
# vpmaddubsw, whose u8·s8 pair sums saturate at int16 (2·255·127 > 2^15): on an AMD Zen 3 ``onednn_mm`` came out
# up to 5.3 off its two-term formula (outputs of ~10), where VNNI CPUs match it to 1e-5
EXACT_INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def has_onednn(flags: frozenset[str] | None = None) -> bool:
    """Whether torch has oneDNN's quantised linear (``torch.ops.onednn.qlinear_pointwise``, x86 builds) and the
    CPU (``flags``; default: the real one's, ``cpu.probe``) runs its int8 sums exactly (``EXACT_INT8_FLAGS``)."""
    ops = getattr(torch.ops, "onednn", None)
    cpu = probe().flags if flags is None else flags
    return (
        torch.backends.mkldnn.is_available()
        and all(hasattr(ops, n) for n in ("qlinear_prepack", "qlinear_pointwise"))
        and any(f in cpu for f in EXACT_INT8_FLAGS)
    )


def onednn_mm(x2: Tensor, packed: Tensor, scale: Tensor, zeros: Tensor) -> Tensor:
    """(M, I) float rows times Q prepacked by ``torch.ops.onednn.qlinear_prepack`` -> (M, O) fp32.

    Each row m gets two int8 terms (as the AVX2 kernel's ``terms=2``, ~15 bits, but per row, not per
    group): s1_m = max_i |x_mi| / 127, q1 = round(x / s1), r = x − s1·q1, s2_m = max_i |r_mi| / 127,
    q2 = round(r / s2). The 2M rows go through one u8 x s8 GEMM (zero point 128, x scale 1, so each
    output is s_o · Σ_i Q_oi · q_t,m,i from int32 sums), then
    y_m = s1_m · y1_m + s2_m · y2_m. Two terms at every M: on the 49152 x 576 unembedding one term per row
    is 1.59 ms at M = 1 against two terms' 1.70 (docs/quant.md), but 8e-3 off the float64 product (relative
    to its max) against 3e-5 — further off than torch's bf16 kernel (6e-3)."""
    x = x2.float()  # (M, I)
    M = x.shape[0]
    s1 = x.abs().amax(1, keepdim=True) / QMAX8  # (M, 1)
    s1 = torch.where(s1 > 0, s1, torch.ones_like(s1))
    q1 = torch.round(x / s1)
    r = x - q1 * s1
    s2 = r.abs().amax(1, keepdim=True) / QMAX8
    s2 = torch.where(s2 > 0, s2, torch.ones_like(s2))
    q2 = torch.round(r / s2).clamp(-QMAX8, QMAX8)
    xq = (torch.cat([q1, q2]) + 128).to(torch.uint8)  # (2M, I), in [1, 255]
    y = torch.ops.onednn.qlinear_pointwise(
        xq, 1.0, 128, packed, scale, zeros, None, 1.0, 0, torch.float32, "none", [], ""
    )  # (2M, O)
    return y[:M].mul_(s1).addcmul_(y[M:], s2)  # in place: no third (M, O) buffer


# the row counts the oneDNN measurement tries (from one row: on a large weight such as the 49152 x 576
# unembedding it wins at M = 1 already, on a small one its quantisation ops cost more than they save)
ONEDNN_ROWS_CANDIDATES = (1, 2, 4, 8, 16, 32)


def measure_onednn_rows(q: Tensor, s: Tensor):
    """``measure(M) -> (s of torch's int8 kernel, s of onednn_mm)`` on the layer's own codes Q (O, I) and
    scales s (O,): ``linear.gemm_rows``'s measurement for ``Int8Linear(kernel="aten")``, prepacking Q at
    the first call."""
    g = torch.Generator().manual_seed(0)
    O, I = q.shape
    s_c, zeros, packed = s.bfloat16(), torch.zeros(O, dtype=torch.long), []

    def measure(M: int) -> tuple[float, float]:
        if not packed:
            packed.append(torch.ops.onednn.qlinear_prepack(q, None))
        x = torch.randn(M, I, generator=g)
        with torch.inference_mode():
            return best_seconds_pair(
                lambda: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, s_c),
                lambda: onednn_mm(x, packed[0], s, zeros),
            )

    return measure


def onednn_gemm_rows(q: Tensor, s: Tensor) -> int | None:
    """From how many rows ``onednn_mm`` beats torch's int8 kernel on this (O, I) weight: measured once per
    process and shape on these codes (``linear.gemm_rows``, key ``int8_onednn_OxI``; the env switch forces it)."""
    O, I = q.shape
    return gemm_rows(f"int8_onednn_{O}x{I}", measure_onednn_rows(q, s), ONEDNN_ROWS_CANDIDATES)


def pack_int8(q: Tensor) -> Tensor:
    """Q (O, I) int8 -> (O/16, I/4, 64) for the AVX2 kernel: byte 4r + j of chunk c in tile t is Q[16t + r, 4c + j]."""
    O, I = q.shape
    return (
        q.reshape(O // 16, 16, I // 4, 4)
        .permute(0, 2, 1, 3)
        .reshape(O // 16, I // 4, 64)
        .contiguous()
    )


def unpack_int8(packed: Tensor) -> Tensor:
    """The inverse of ``pack_int8``: (O/16, I/4, 64) -> Q (O, I)."""
    T, C, _ = packed.shape
    return packed.view(T, C, 16, 4).permute(0, 2, 1, 3).reshape(T * 16, C * 4)


class Int8Linear(WeightOnlyLinear):
    """y = x Ŵᵀ (+ b) with Ŵ stored as int8 Q (O, I) and fp scales s (O,).

    ``compute_dtype`` is the dtype the activation is cast to for the matmul: bf16 (default) is
    what the CPU int8 kernel is fast for (an fp32 activation takes a ~10x slower path there);
    the output is cast back to the input's dtype. With ``DEQUANT_ROWS`` or more rows (prefill),
    off CPU, or without the kernel, the weight is dequantised and F.linear runs. ``kernel``: "auto" takes
    lmstack's AVX2 kernel where ``int8_kernel()`` says so (then ``qweight`` holds Q in its tile layout and
    the activations are quantised to int8 per group of ``act_group`` inputs, ``terms`` int8 terms each: None, the
    default, takes ``default_terms()`` = 1 unless ``LMSTACK_INT8_TERMS=2``; "auto" takes ours only with bf16
    ``compute_dtype``: fp32 asks for the exact product), "aten" torch's, "avx2" ours.
    With torch's kernel, bf16 ``compute_dtype`` and oneDNN, from ``gemm_rows`` rows on (measured once per process
    and weight shape: ``onednn_gemm_rows``;
    ``LMSTACK_QUANT_GEMM_ROWS=N|never`` forces it) ``onednn_mm`` runs instead of the kernel and of the
    dequantisation, on Q prepacked at the first such call (one more byte per weight).
    """

    DEQUANT_ROWS = (
        32  # from this many rows on, dequantise and use F.linear (lmstack's kernel: measured)
    )

    def __init__(
        self,
        q: Tensor,
        scale: Tensor,
        bias: Tensor | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        kernel: str = "auto",
        terms: int | None = None,
    ):
        if terms not in (None, 1, 2):
            raise ValueError(
                f"terms={terms!r}; expected 1 or 2 int8 terms per activation (or None)"
            )
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(
                f"expected int8 Q (O, I) and scales (O,), got {q.dtype} {tuple(q.shape)} "
                f"and {tuple(scale.shape)}"
            )
        super().__init__(*q.shape, bias, compute_dtype)
        O, I = q.shape
        if kernel not in ("auto", "aten", "avx2"):
            raise ValueError(f"kernel={kernel!r}; expected 'auto', 'aten' or 'avx2'")
        self.act_group = next(
            (g for g in (32, 16, 8) if I % g == 0), 0
        )  # the kernel's activation groups
        shape_ok = O % 16 == 0 and self.act_group > 0
        if kernel == "avx2" and (
            why := int4_vnni.build("int8_avx2") or (None if shape_ok else f"shape ({O}, {I})")
        ):
            raise ValueError(f"kernel='avx2' cannot run: {why}")
        self.kernel = (
            "avx2"
            # "auto": ours only for bf16 compute (its int8 activations); fp32 asks for the exact product
            if kernel == "avx2"
            or (
                kernel == "auto"
                and shape_ok
                and compute_dtype == torch.bfloat16
                and int8_kernel() == "avx2"
            )
            else "aten"
        )
        # int8 terms per activation in lmstack's AVX2 kernel (1: llama.cpp's Q8_0 precision)
        self.terms = default_terms() if terms is None else terms
        if (
            self.kernel == "avx2"
        ):  # the row count from which a prefill dequantises: measured (linear.gemm_rows)
            self.DEQUANT_ROWS = gemm_rows(
                f"int8_avx2_t{self.terms}", measure_gemm_rows(terms=self.terms)
            )
        self._onednn: tuple[Tensor, Tensor, tuple] | None = (
            None  # (prepacked Q, zero points, qweight's key)
        )
        self.register_buffer("qweight", pack_int8(q) if self.kernel == "avx2" else q.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer(
            "scale_c", scale.to(compute_dtype).contiguous()
        )  # s in the kernel's dtype
        self._choose_onednn()

    def _choose_onednn(self) -> None:
        """torch's kernel with bf16 compute (fp32 activations ask for the exact product) and oneDNN: from
        ``gemm_rows`` rows on (measured on this weight's shape, ``onednn_gemm_rows``; None: never) oneDNN's
        int8 GEMM, which then also takes the many-row batches the dequantisation took."""
        self.gemm_rows = None
        if (
            self.kernel == "aten"
            and self.compute_dtype == torch.bfloat16
            and self.qweight.device.type
            == "cpu"  # measured on these codes (not on meta, not off the CPU)
            and has_onednn()
            and _has_int8_kernel()
        ):
            self.gemm_rows = onednn_gemm_rows(self.qweight, self.scale)
        if self.gemm_rows is not None:
            self.DEQUANT_ROWS = None
        elif self.kernel == "aten":
            self.DEQUANT_ROWS = type(self).DEQUANT_ROWS

    def _measure_for_shape(self) -> None:
        self._onednn = None
        self._choose_onednn()

    def onednn_rows(self, rows: int) -> bool:
        """Whether an eager call on ``rows`` activation rows runs oneDNN's int8 GEMM (a compiled graph cannot:
        a caller that compiles around this layer may keep it outside the graph, as ``StaticDecoder`` does)."""
        return self.gemm_rows is not None and rows >= self.gemm_rows

    @classmethod
    def from_linear(
        cls, linear: nn.Module, compute_dtype: torch.dtype = torch.bfloat16
    ) -> Int8Linear:
        q, s = quantize_int8(linear.weight)
        return cls(q, s, getattr(linear, "bias", None), compute_dtype)

    @classmethod
    def from_weight(cls, weight: Tensor, compute_dtype: torch.dtype = torch.bfloat16) -> Int8Linear:
        q, s = quantize_int8(weight)
        return cls(q, s, None, compute_dtype)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_int8(
            unpack_int8(self.qweight) if self.kernel == "avx2" else self.qweight, self.scale, dtype
        )

    def kernel_bytes(self) -> int:
        """Bytes the matmul reads: Q (1 byte per weight) and the scales."""
        scale = self.scale if self.kernel == "avx2" else self.scale_c
        return self.qweight.numel() + scale.numel() * scale.element_size()

    def _rows_first(self) -> bool:  # Q (O, I) or its (O/16, I/4, 64) tiles, s (O,)
        return True

    def _kernel_ok(self) -> bool:
        return _has_int8_kernel()

    def _kernel_mm(self, x2: Tensor) -> Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale_c)  # (M, O)

    def forward(self, x: Tensor) -> Tensor:  # (..., I) -> (..., O)
        if (
            self.kernel == "avx2"
            and x.device.type == "cpu"
            and (self.DEQUANT_ROWS is None or x.numel() // self.in_features < self.DEQUANT_ROWS)
        ):
            # fp32 or bf16 x straight in (not cast to compute_dtype): the kernel quantises it to int8
            y = torch.ops.lmstack_quant.int8_avx2_mm(
                x.reshape(-1, self.in_features),
                self.qweight,
                self.scale,
                self.act_group,
                self.terms,
            )  # (M, O) fp32
            y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if (  # not inside torch.compile: inductor cannot take the opaque prepacked Q (torch's kernel runs)
            x.device.type == "cpu"
            and self.onednn_rows(x.numel() // self.in_features)
            and not torch.compiler.is_compiling()
        ):
            # Q in oneDNN's blocked layout (one more byte per weight), zero points; built again when
            # qweight was replaced or written in place since (load_state_dict, a weight sync), and by a
            # fused copy (concat_rows) for its own joined Q
            w = self.qweight  # an inference tensor tracks no version: its storage alone is the key
            key = (w.data_ptr(), None if w.is_inference() else w._version)
            cached = getattr(self, "_onednn", None)
            if cached is None or cached[2] != key:
                cached = self._onednn = (
                    torch.ops.onednn.qlinear_prepack(self.qweight, None),
                    torch.zeros(self.out_features, dtype=torch.long),
                    key,
                )
            packed, zeros, _ = cached
            y = onednn_mm(x.reshape(-1, self.in_features), packed, self.scale, zeros)
            y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        return super().forward(x)

    def __getstate__(
        self,
    ):  # the prepacked Q is opaque (no deepcopy, no pickle): rebuilt when next needed
        return {**self.__dict__, "_onednn": None}

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f", kernel={self.kernel}, terms={self.terms}, gemm_rows={self.gemm_rows}"
        )
