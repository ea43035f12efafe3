"""Compile lmstack's Triton kernels ahead of time for a GPU target, without a GPU.

Run as a script in a process *without* TRITON_INTERPRET (the interpreter replaces @triton.jit
functions). ``triton.compile`` lowers each kernel through TTIR -> TTGIR -> LLVM -> PTX -> cubin
(Triton ships ptxas), so typing errors that the interpreter does not see, and the shared memory
each tile configuration needs, show up on a CPU-only machine. Only the configurations the
autotuner's pruning keeps for (dtype, H) are compiled. Prints one JSON object per kernel
configuration: {"kernel", "dtype", "H", "BLOCK_Q", "BLOCK_K", "num_warps", "num_stages", "shared"}
or {"error": ...}.

    python tests/kernels/kernel_aot.py 90 bf16 64,128
    python tests/kernels/kernel_aot.py 90 bf16 64 --ptxas-stats     # + registers and spills per config
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import lmstack.kernels.flash_triton as ft  # noqa: E402
import lmstack.kernels.triton_rmsnorm as rt  # noqa: E402

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def signature(fn, pointers: dict, floats=(), constexprs=()):
    sig = {}
    for name in fn.arg_names:
        sig[name] = pointers.get(name) or (
            "constexpr" if name in constexprs else "fp32" if name in floats else "i32"
        )
    return sig


UNIT_STRIDES = (
    "stride_qh",
    "stride_kh",
    "stride_vh",
    "stride_oh",
    "stride_gh",
    "stride_dqh",
    "stride_lt",
)
PTXAS_STATS = "--ptxas-stats" in sys.argv


def compile_kernel(fn, sig, constexprs: dict, target, num_warps: int, num_stages: int) -> dict:
    """Compile as the JIT would for contiguous tensors: a stride equal to 1 becomes a constant
    (Triton specialises integer arguments equal to 1), pointers and other strides are known to be
    multiples of 16. Returns {"shared": bytes} [+ "regs", "spill_bytes" from ``ptxas -v`` with
    --ptxas-stats: registers per thread and bytes spilled to local memory]."""
    unit = {a: 1 for a in fn.arg_names if a in UNIT_STRIDES}
    sig = {a: ("constexpr" if a in unit else t) for a, t in sig.items()}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, a in enumerate(fn.arg_names)
        if sig[a].startswith("*") or (a.startswith("stride_") and a not in unit)
    }
    consts = {(fn.arg_names.index(k),): v for k, v in {**constexprs, **unit}.items()}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
        target=target,
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    out = {"shared": compiled.metadata.shared}
    if PTXAS_STATS:  # the register allocation the GPU would run with; needs a second ptxas pass
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        with tempfile.TemporaryDirectory() as d:
            Path(d, "k.ptx").write_text(compiled.asm["ptx"])
            log = subprocess.run(
                [
                    ptxas,
                    "-lineinfo",
                    "-v",
                    "--regAllocOptLevel=2",
                    f"--gpu-name=sm_{target.arch}a",
                    str(Path(d, "k.ptx")),
                    "-o",
                    str(Path(d, "k.o")),
                ],
                capture_output=True,
                text=True,
            )
        text = log.stdout + log.stderr
        out["regs"] = int(re.search(r"Used (\d+) registers", text).group(1))
        out["spill_bytes"] = int(re.search(r"(\d+) bytes spill stores", text).group(1))
    return out


def main() -> None:
    arch, dtypes, head_dims = (
        int(sys.argv[1]),
        sys.argv[2].split(","),
        [int(h) for h in sys.argv[3].split(",")],
    )
    target = GPUTarget("cuda", arch, 32)
    attn_constexprs = (
        "CAUSAL",
        "BLOCK_Q",
        "BLOCK_K",
        "BLOCK_H",
        "UPCAST",
        "PRECISION",
        "ATOMIC_DQ",
    )
    for dt in dtypes:
        p = f"*{dt}"
        bwd = dict(Q=p, K=p, V=p, DO=p, L="*fp32", Dl="*fp32", DK=p, DV=p)
        kernels = [  # (name, kernel, configs, pointer types, float scalars, extra constexprs)
            (
                "fwd",
                ft._attn_fwd_kernel,
                ft._FWD_CONFIGS,
                dict(Q=p, Kt=p, V=p, O=p, L="*fp32"),
                ("qk_scale",),
                {},
            ),
            (
                "dkdv",
                ft._attn_bwd_dkdv_kernel,
                ft._DKDV_CONFIGS,
                dict(bwd, DQ=p),
                ("qk_scale", "scale"),
                dict(ATOMIC_DQ=False),
            ),
            (
                "dkdv_atomic_dq",
                ft._attn_bwd_dkdv_kernel,
                ft._DKDV_CONFIGS,
                dict(bwd, DQ="*fp32"),
                ("qk_scale", "scale"),
                dict(ATOMIC_DQ=True),
            ),
            (
                "dq",
                ft._attn_bwd_dq_kernel,
                ft._DQ_CONFIGS,
                dict(Q=p, K=p, V=p, DO=p, L="*fp32", Dl="*fp32", DQ=p),
                ("qk_scale", "scale"),
                {},
            ),
        ]
        for H in head_dims:
            for name, fn, configs, ptrs, floats, extra in kernels:
                sig = signature(fn, ptrs, floats, attn_constexprs)
                for cfg in ft._prune(
                    configs, {"Q": torch.empty(0, dtype=TORCH_DTYPES[dt]), "H": H}
                ):
                    row = dict(
                        kernel=name,
                        dtype=dt,
                        H=H,
                        **cfg.kwargs,
                        num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages,
                    )
                    consts = dict(
                        CAUSAL=True,
                        BLOCK_H=H,
                        UPCAST=False,
                        PRECISION="ieee" if dt == "fp32" else "tf32",
                        **cfg.kwargs,
                        **extra,
                    )
                    try:
                        row |= compile_kernel(
                            fn, sig, consts, target, cfg.num_warps, cfg.num_stages
                        )
                    except Exception as e:  # report, let the caller decide
                        row["error"] = repr(e)[:500]
                    print(json.dumps(row), flush=True)
            # the backward's D = rowsum(dO ∘ O) preprocessing, at the tile the launcher uses on a GPU
            sig = signature(
                ft._attn_bwd_delta_kernel, dict(O=p, DO=p, Dl="*fp32"), (), ("BLOCK_T", "BLOCK_H")
            )
            row = dict(kernel="delta", dtype=dt, H=H, num_warps=4, num_stages=2)
            try:
                row |= compile_kernel(
                    ft._attn_bwd_delta_kernel, sig, dict(BLOCK_T=8192 // H, BLOCK_H=H), target, 4, 2
                )
            except Exception as e:
                row["error"] = repr(e)[:500]
            print(json.dumps(row), flush=True)
        # fused RMSNorm at D = 4096 (one D tile), 1 row per program as _tiles picks on a GPU
        tl_dtype = {
            "bf16": triton.language.bfloat16,
            "fp16": triton.language.float16,
            "fp32": triton.language.float32,
        }[dt]
        for name, fn, ptrs, consts in [
            (
                "rmsnorm_fwd",
                rt._rmsnorm_fwd_kernel,
                dict(X=p, W=p, Y=p, R="*fp32"),
                dict(ROWS=2, BLOCK_D=4096, X_DTYPE=tl_dtype),
            ),
            (
                "rmsnorm_bwd",
                rt._rmsnorm_bwd_kernel,
                dict(X=p, W=p, DY=p, R="*fp32", DX=p, DW_PARTIAL="*fp32"),
                dict(ROWS=2, BLOCK_D=4096),
            ),
        ]:
            sig = signature(fn, ptrs, ("eps",), tuple(consts))
            row = dict(kernel=name, dtype=dt, num_warps=8, num_stages=2)
            try:
                row |= compile_kernel(fn, sig, consts, target, 8, 2)
            except Exception as e:
                row["error"] = repr(e)[:500]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
