"""lmstack's C++ paged decode attention (``csrc/paged_decode.cpp``): the compiled decode step's and the eager
decode batch's attention over the paged pool, reading only each row's real blocks (vLLM's PagedAttention,
Kwon et al. 2023; FlashAttention-2's online softmax, Dao 2023).

Same inputs and result as ``paged_attention.paged_decode_attention`` (the torch formula, kept as the
reference and the fallback), but per (row, KV head) the kernel reads slots lo .. p_b only — not the table's
padding to its bucket — loads each key and value row once for the G query heads that share it (GQA), and
keeps a running max and sum (no (B, N, S) score tensor). Pools: float32 / bfloat16 / float16, or int8 / fp8
codes with their per-(block, KV head) scales; q float32 / bfloat16 / float16 (a float64 q takes the torch
formula, which computes in float64).

The AVX-512 and AVX2 builds read the pool's rows in their stored dtype and convert them in registers (16
or 8 values at a time: fp16 with ``vcvtph2ps``, bf16 by a shift, int8, fp8 through fp16's bit fields)
inside vector score and P·V loops, one pass over a tile's rows for groups of up to 4 of the G query heads
(AVX2's blocks sized for its 16 registers; a head dim not a multiple of 8 reads its last values through a
zeroed copy); the generic build converts each row once into an fp32 buffer and runs plain loops for the
compiler to vectorise. Built on first use (``utils.build_extension``)
once per ISA: "avx512" (``-mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma``, 512-bit vectors), "avx2"
(``-mavx2 -mfma -mf16c``: any AVX2 CPU) or "generic" (``-O3`` only: SSE2 on x86, NEON on aarch64). Each
registers ``torch.ops.lmstack_attn.paged_decode_<variant>`` with a ``register_fake`` shape function, so the
compiled block graph calls it without a graph break. The variant follows the CPU's flags as
``cpu.cpu_features()`` reads them (``LMSTACK_CPU=avx2`` makes an AVX-512 machine choose the avx2 build, as it does
for the int4/int8 kernels); a build still needs the real CPU's flags (``cpu.probe``). ``LMSTACK_PAGED_KERNEL=auto|cpp|torch|avx512|avx2|generic`` forces one (``torch``: the
formula; a variant the CPU lacks or that fails to build falls back to the formula, the reason logged once).
The file lives with the engine (``inference/csrc``) rather than in ``kernels/`` because its layout is the
engine's pool (``inference.paged``) and its only callers are the decode step's seams.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch
from torch import Tensor

from lmstack.cpu import cpu_features, probe
from lmstack.utils import build_extension

_log = logging.getLogger(__name__)
ENV = "LMSTACK_PAGED_KERNEL"
SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
# variant -> (CPU flags it needs, compiler flags); best first. -fopenmp: at::parallel_for's pragma and the
# source's `omp simd` reductions are compiled into the kernel (without it, one thread, scalar loops);
# -fno-trapping-math lets GCC turn the exp's selects into vector blends (FP exception flags are never read).
VARIANTS: dict[str, tuple[tuple[str, ...], list[str]]] = {
    "avx512": (
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"),
        [
            "-O3",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mfma",
            "-mf16c",
            "-mprefer-vector-width=512",
            "-fno-trapping-math",
            "-fopenmp",
        ],
    ),
    "avx2": (
        ("avx2", "fma", "f16c"),
        ["-O3", "-mavx2", "-mfma", "-mf16c", "-fno-trapping-math", "-fopenmp"],
    ),
    "generic": ((), ["-O3", "-fno-trapping-math", "-fopenmp"]),
}
X86 = ("x86_64", "AMD64", "i686", "i386")
POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn)
Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOCK = threading.Lock()
_built: dict[str, str | None] = {}  # variant -> None (loaded) or why not
_choice: tuple[str, str | None] | None = None  # (variant | "torch", why not the kernel)


def choose_variant(flags, arch: str, forced: str = "") -> tuple[str, str | None]:
    """The variant for a CPU with ISA ``flags`` and ``arch``: (name, None), or ("torch", why not).
    ``forced``: the ``LMSTACK_PAGED_KERNEL`` value (auto/cpp = the best this CPU runs)."""
    forced = (forced or "auto").strip().lower()
    if forced not in ("auto", "cpp", "torch", *VARIANTS):
        raise ValueError(
            f"{ENV}={forced!r}; expected one of auto, cpp, torch, {', '.join(VARIANTS)}"
        )
    if forced == "torch":
        return "torch", f"{ENV}=torch"
    names = [forced] if forced in VARIANTS else list(VARIANTS)
    if arch not in X86:  # the -m flags are x86's: elsewhere the portable build
        names = [n for n in names if n == "generic"]
        if not names:
            return "torch", f"{ENV}={forced}: {arch} runs the generic build only"
    for name in names:
        missing = [f for f in VARIANTS[name][0] if f not in flags]
        if not missing:
            return name, None
    return "torch", f"{ENV}={forced} but the CPU lacks {', '.join(missing)}"


def build(variant: str) -> str | None:
    """Compile and load ``variant`` (if the real CPU has its flags): None when loaded, else the reason."""
    with _LOCK:
        if variant in _built:
            return _built[variant]
        needs, cflags = VARIANTS[variant]
        missing = [f for f in needs if f not in probe().flags]
        if missing:
            why: str | None = f"the CPU lacks {', '.join(missing)}"
        else:
            op = f"paged_decode_{variant}"
            _, why = build_extension(
                f"lmstack_attn_{variant}", SOURCE, [*cflags, f"-DLMSTACK_OP={op}"]
            )
            if why is None:
                try:

                    def fake(q, *args):  # (B, N, 1, H) in q's dtype
                        return q.new_empty(q.shape)

                    torch.library.register_fake(f"lmstack_attn::{op}")(fake)
                except Exception as e:  # noqa: BLE001 — no shape function: the op cannot serve compile
                    why = f"registering {op}'s shape failed: {type(e).__name__}: {e}"
        _built[variant] = why
        return why


def selected() -> tuple[str, str | None]:
    """(the variant the seams call, or "torch", why not the kernel), decided and built on the first call
    (``DecodeStep`` calls it before tracing); a fallback's reason is logged once."""
    global _choice
    if _choice is None:
        cpu = cpu_features()  # a canned machine under LMSTACK_CPU
        forced = os.environ.get(ENV, "")
        name, why = choose_variant(cpu.flags, cpu.arch, forced)
        if name != "torch":
            auto = forced.strip().lower() in ("", "auto", "cpp")
            tried = []
            for cand in list(VARIANTS)[list(VARIANTS).index(name) :] if auto else [name]:
                if choose_variant(cpu.flags, cpu.arch, cand)[0] != cand:
                    continue
                if (err := build(cand)) is None:
                    name, why = cand, None
                    break
                tried.append(f"{cand}: {err}")
            else:
                name, why = "torch", "; ".join(tried)
        if why is not None:
            _log.warning("paged decode kernel off (%s): the torch formula runs", why)
        _choice = (name, why)
    return _choice


def reset() -> None:
    """Forget the choice (tests that change ``LMSTACK_PAGED_KERNEL``); built variants stay loaded."""
    global _choice
    _choice = None


def usable(q: Tensor, k_pool: Tensor) -> bool:
    """Whether the kernel takes this call: chosen, on CPU, q and pool dtypes it reads."""
    return (
        selected()[0] != "torch"
        and q.device.type == "cpu"
        and q.dtype in Q_DTYPES
        and k_pool.dtype in POOL_DTYPES
    )


def paged_decode(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    positions: Tensor,
    k_new: Tensor | None = None,
    v_new: Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    variant: str | None = None,
) -> Tensor:
    """``paged_attention.paged_decode_attention``'s arguments and result (q (B, N, 1, H) -> (B, N, 1, H)) from
    the C++ kernel ``variant`` (None: the chosen one; a named one must be built: ``build(variant)`` is None)."""
    name = variant or selected()[0]
    op = getattr(torch.ops.lmstack_attn, f"paged_decode_{name}")
    return op(
        q,
        k_pool,
        v_pool,
        table,
        positions,
        k_new,
        v_new,
        k_scale,
        v_scale,
        window or 0,
        float(softcap or 0.0),
    )
