"""lmstack's own int4 matmul for decode: int4 codes x int8 activations with AVX-512 VNNI (seed 001 "量化",
"性能指标分析": at batch 1 every weight is read once per token, so the kernel has to keep pace with memory).

The C++ kernel (``csrc/int4_vnni.cpp``, compiled on first use with ``torch.utils.cpp_extension`` and
registered as ``torch.ops.lmstack_quant.int4_vnni_mm``, so a compiled decode step calls it without a graph
break) computes, per output row o and group g of G inputs, with the weight w = d·q + m (q ∈ 0..15) and the
activations quantised per group, s_x = max|x|/127, x_q = round(x / s_x):

    y_o = Σ_g d_og · s_x,g · Σ_{i∈g} q_oi · x_q,i  +  m_og · Σ_{i∈g} x_i

(llama.cpp's Q4_1 × Q8_1 dot product has the same form). By default (``terms=2``) each activation is two
int8 terms, x ≈ s_x1·x_q1 + s_x2·x_q2 with x_q2 the rounded residual: one 8-bit term alone cost SmolLM2
+0.9% perplexity, the pair keeps ~15 bits for a second ``vpdpbusd`` on codes already unpacked. ``pack`` lays the codes out in tiles of 16 output
rows (one ``vpdpbusd`` = 16 rows × 4 inputs, one int32 lane per row) and d, m as fp16. Per call the kernel
quantises the activations with AVX-512 into a per-thread scratch buffer, accumulates both terms into one
output and prefetches the codes 8 KiB ahead (a decode step streams every weight from DRAM once).
Needs a CPU with avx512f/avx512bw/avx512_vnni and a C++ compiler; ``status()`` says why it is off
otherwise (``Int4Linear`` then uses torch's ``_weight_int4pack_mm_for_cpu``). ``LMSTACK_INT4_KERNEL=aten``
turns it off.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path

import torch
from torch import Tensor

from lmstack.utils import build_extension

_log = logging.getLogger(__name__)
_BUILD_LOCK = threading.Lock()
_FAKE_REGISTERED: list[bool] = []  # the op's shape function, registered with the first successful build
SOURCE = Path(__file__).with_name("csrc") / "int4_vnni.cpp"
FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "f16c")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@functools.cache
def status() -> str | None:
    """None when the kernel is built and loaded, else the reason it is not used (built at the first call,
    under a lock so two threads never build it twice; the reason is logged once as a warning on
    ``lmstack.quant.int4_vnni``)."""
    with _BUILD_LOCK:
        reason = _build()
    if reason is not None:
        _log.warning("int4 VNNI kernel off: %s; Int4Linear uses torch's _weight_int4pack_mm_for_cpu", reason)
    return reason


def _build() -> str | None:
    if os.environ.get("LMSTACK_INT4_KERNEL", "").lower() == "aten":
        return "LMSTACK_INT4_KERNEL=aten"
    missing = [f for f in FLAGS if f not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    # -fopenmp: at::parallel_for is a header template whose OpenMP pragma is compiled into this kernel;
    # without the flag it silently runs on one thread.
    cflags = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma", "-fopenmp"]
    _, reason = build_extension("lmstack_int4_vnni", SOURCE, cflags, ["-fopenmp"])
    if reason is not None:
        return reason
    try:
        if not _FAKE_REGISTERED:  # once per process, even if status() is asked again (its cache cleared)

            @torch.library.register_fake("lmstack_quant::int4_vnni_mm")
            def _(x, packed, d, m, G, terms=2):  # shapes for torch.compile
                return x.new_empty((x.shape[0], packed.shape[0] * 16), dtype=torch.float32)

            _FAKE_REGISTERED.append(True)
    except Exception as e:  # noqa: BLE001 — a registration failure means: use torch's kernel
        return f"registering {SOURCE.name}'s shapes failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None


def available() -> bool:
    return status() is None


def pack(q: Tensor, scale: Tensor, lo: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q (O, I) uint8 codes, scale and minimum (O, I/G) -> packed (O/16, I/8, 64) uint8, d, m (O/16, I/G, 16) fp16.

    Byte 4r + j of chunk c in tile t holds q[16t + r, 8c + j] (low nibble) and q[16t + r, 8c + 4 + j] (high)."""
    O, I = q.shape
    if O % 16 or I % 8:
        raise ValueError(f"int4 VNNI layout needs out_features % 16 == 0 and in_features % 8 == 0, got ({O}, {I})")
    t = q.to(torch.uint8).view(O // 16, 16, I // 8, 2, 4)  # (tile, row, chunk, low|high, j)
    packed = (t[:, :, :, 0] | (t[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(O // 16, I // 8, 64)

    def tiles(a: Tensor) -> Tensor:
        return a.float().view(O // 16, 16, -1).permute(0, 2, 1).to(torch.float16).contiguous()  # (O/16, I/G, 16)

    return packed.contiguous(), tiles(scale), tiles(lo)


def unpack(packed: Tensor) -> Tensor:
    """The inverse of ``pack`` for the codes: (O/16, I/8, 64) -> Q (O, I) uint8."""
    T, C, _ = packed.shape
    b = packed.view(T, C, 16, 4)
    q = torch.stack([b & 0xF, b >> 4], dim=3)  # (tile, chunk, row, low|high, j)
    return q.permute(0, 2, 1, 3, 4).reshape(T * 16, C * 8)


def mm(x: Tensor, packed: Tensor, d: Tensor, m: Tensor, group_size: int, terms: int = 2) -> Tensor:
    """x (M, I) float -> (M, O) float32 through the kernel (``available()`` must be True). ``terms=2``: each
    activation as two int8 terms, x ≈ s_x1·x_q1 + s_x2·x_q2 (the second rounds the residual; ~15 bits)."""
    return torch.ops.lmstack_quant.int4_vnni_mm(x, packed, d, m, group_size, terms)
