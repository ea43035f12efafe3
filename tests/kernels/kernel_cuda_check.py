"""Check the compiled Triton kernels on a CUDA GPU against the fp64 references (run without
TRITON_INTERPRET; ``test_kernels_cuda.py`` runs it in a subprocess when a GPU is present).

    python tests/kernels/kernel_cuda_check.py
Prints one line per case and exits non-zero on the first mismatch.
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from kernel_refs import attention_error_bounds, reference_attention  # noqa: E402

from lmstack.kernels.flash_triton import flash_attention_triton  # noqa: E402
from lmstack.kernels.triton_rmsnorm import rmsnorm_triton  # noqa: E402

# (B, N, K, T, S, H, causal)
CASES = [
    (2, 8, 8, 256, 256, 64, True),
    (1, 8, 2, 333, 333, 128, True),
    (2, 4, 1, 100, 300, 64, True),
    (1, 4, 4, 200, 200, 80, False),
    (1, 2, 2, 64, 64, 16, True),
]
FP32_TOLS = (2e-5, 1e-4)  # (atol, rtol); fp32 inputs use exact ieee dots
# Low precision: the tolerance is the rounding error itself. Unit roundoff u (round to nearest)
# and the subnormal spacing of the dtype; ``attention_error_bounds`` turns them into an
# elementwise bound on each output and gradient from where the kernels round (P and dS before the
# tensor-core dots, O for D = rowsum(dO ∘ O), every stored result). SAFETY covers what the
# first-order bound leaves out (fp32 accumulation order, exp2's approximation, r² terms); an
# emulation of exactly these roundings on CPU stays below 0.9 of the bound on these cases.
UNIT_ROUNDOFF = {torch.bfloat16: (2.0**-8, 0.0), torch.float16: (2.0**-11, 2.0**-24)}
SAFETY = 2.0
# The log-sum-exp is fp32 arithmetic on exact products of two low-precision inputs: its error is
# about log2(H)·2^-24·Σ|q_i k_i|/√H ≈ 1e-5 for unit-variance inputs; 1e-3 leaves a wide margin.
LSE_ATOL = 1e-3


def assert_within(got, ref, bound, name):
    err = (got.detach().double() - ref).abs()
    worst = float((err - SAFETY * bound).max())
    ratio = float((err / (bound + 1e-30)).max())
    assert worst <= 1e-6, (
        f"{name}: error exceeds {SAFETY} x the rounding bound (max error/bound {ratio:.2f})"
    )
    return ratio


def check(mode: str, dtype: torch.dtype, B, N, K, T, S, H, causal, tiles: dict) -> None:
    os.environ["LMSTACK_FLASH_BWD"] = mode
    q, k, v = (
        torch.randn(B, n, L, H, device="cuda").to(dtype).requires_grad_()
        for n, L in ((N, T), (K, S), (K, S))
    )
    do = torch.randn(B, N, T, H, device="cuda").to(dtype)
    out, lse = flash_attention_triton(q, k, v, causal=causal, return_lse=True, **tiles)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference_attention(q64, k64, v64, causal)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    seen = torch.isfinite(ref_lse)
    if dtype == torch.float32:
        atol, rtol = FP32_TOLS
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=atol, rtol=rtol)
        for name, g, rg in zip("qkv", grads, ref_grads):
            scale = rg.abs().max().item()
            torch.testing.assert_close(
                g.double(),
                rg,
                atol=atol * max(1.0, scale),
                rtol=rtol,
                msg=lambda m: f"d{name}: {m}",  # noqa: B023
            )
        detail = ""
    else:
        u, tiny = UNIT_ROUNDOFF[dtype]
        bounds = attention_error_bounds(q, k, v, do, causal, u, tiny)
        torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=LSE_ATOL, rtol=0)
        ratios = [
            assert_within(g, r, b, name)
            for g, r, b, name in zip(
                (out, *grads), (ref, *ref_grads), bounds, ("O", "dQ", "dK", "dV")
            )
        ]
        detail = " error/bound " + " ".join(f"{x:.2f}" for x in ratios)
    print(
        f"flash_triton ok {mode} {dtype} B={B} N={N} K={K} T={T} S={S} H={H} causal={causal} "
        f"tiles={tiles or 'autotuned'}{detail}",
        flush=True,
    )


def main() -> None:
    torch.manual_seed(0)
    # Fixed tiles keep the number of compilations small (autotuning would compile every
    # candidate tile for every head-dim block and dtype); both backward schedules, all cases in
    # fp32 and bf16, fp16 on two; then the autotuned path once per schedule (bf16, H = 64).
    # (fp32 takes 32 × 32: large fp32 tiles with ieee dots take minutes in ptxas.)
    fixed = {
        torch.float32: dict(block_q=32, block_k=32),
        torch.bfloat16: dict(block_q=64, block_k=64),
        torch.float16: dict(block_q=64, block_k=64),
    }
    for mode in ("atomic", "split"):
        for dtype in (torch.float32, torch.bfloat16):
            for case in CASES:
                check(mode, dtype, *case, fixed[dtype])
        for case in CASES[:2]:
            check(mode, torch.float16, *case, fixed[torch.float16])
        check(mode, torch.bfloat16, *CASES[0], {})
    os.environ.pop("LMSTACK_FLASH_BWD")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 77, 4096, device="cuda").to(dtype).requires_grad_()
        w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(dtype).requires_grad_()
        y = rmsnorm_triton(x, w, 1e-5)
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        ref = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
        dy = torch.randn_like(y)
        g = torch.autograd.grad(y, (x, w), dy)
        rg = torch.autograd.grad(ref, (x64, w64), dy.double())
        if dtype == torch.float32:
            tol = 1e-5
            torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)
            torch.testing.assert_close(g[0].double(), rg[0], atol=tol * 10, rtol=tol)
            torch.testing.assert_close(
                g[1].double(), rg[1], atol=tol * rg[1].abs().max().item(), rtol=tol
            )
        else:
            # y is rounded twice (the normalised x, then γ ⊙ it), dx and dγ once, each by at most
            # u = 2^-8 relative (round to nearest); fp32 inside. SAFETY x that, elementwise, plus an
            # absolute floor for fp32 accumulation (log2(D)·2^-24 of the sums' magnitudes).
            u = UNIT_ROUNDOFF[dtype][0]
            torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=SAFETY * 2 * u)
            torch.testing.assert_close(g[0].double(), rg[0], atol=1e-4, rtol=SAFETY * u)
            torch.testing.assert_close(
                g[1].double(), rg[1], atol=1e-4 * rg[1].abs().max().item(), rtol=SAFETY * u
            )
        print(f"rmsnorm_triton ok {dtype}", flush=True)


if __name__ == "__main__":
    main()
