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
from kernel_refs import reference_attention  # noqa: E402

from lmstack.kernels.flash_triton import flash_attention_triton  # noqa: E402
from lmstack.kernels.triton_rmsnorm import rmsnorm_triton  # noqa: E402

# (B, N, K, T, S, H, causal)
CASES = [(2, 8, 8, 256, 256, 64, True), (1, 8, 2, 333, 333, 128, True), (2, 4, 1, 100, 300, 64, True),
         (1, 4, 4, 200, 200, 80, False), (1, 2, 2, 64, 64, 16, True)]
TOLS = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


def check(mode: str, dtype: torch.dtype, B, N, K, T, S, H, causal, tiles: dict) -> None:
    os.environ["LMSTACK_FLASH_BWD"] = mode
    atol, rtol = TOLS[dtype]
    q, k, v = (torch.randn(B, n, L, H, device="cuda").to(dtype).requires_grad_()
               for n, L in ((N, T), (K, S), (K, S)))
    do = torch.randn(B, N, T, H, device="cuda").to(dtype)
    out, lse = flash_attention_triton(q, k, v, causal=causal, return_lse=True, **tiles)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference_attention(q64, k64, v64, causal)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=atol, rtol=rtol)
    for name, g, rg in zip("qkv", grads, ref_grads):
        scale = rg.abs().max().item()
        torch.testing.assert_close(g.double(), rg, atol=atol * max(1.0, scale), rtol=rtol,
                                   msg=lambda m: f"d{name}: {m}")
    print(f"flash_triton ok {mode} {dtype} B={B} N={N} K={K} T={T} S={S} H={H} causal={causal} "
          f"tiles={tiles or 'autotuned'}", flush=True)


def main() -> None:
    torch.manual_seed(0)
    # Fixed tiles keep the number of compilations small (autotuning would compile every
    # candidate tile for every head-dim block and dtype); both backward schedules, all cases in
    # fp32 and bf16, fp16 on two; then the autotuned path once per schedule (bf16, H = 64).
    # (fp32 takes 32 × 32: large fp32 tiles with ieee dots take minutes in ptxas.)
    fixed = {torch.float32: dict(block_q=32, block_k=32), torch.bfloat16: dict(block_q=64, block_k=64),
             torch.float16: dict(block_q=64, block_k=64)}
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
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(g[0].double(), rg[0], atol=tol * 10, rtol=tol)
        torch.testing.assert_close(g[1].double(), rg[1], atol=tol * rg[1].abs().max().item(), rtol=tol)
        print(f"rmsnorm_triton ok {dtype}", flush=True)


if __name__ == "__main__":
    main()
