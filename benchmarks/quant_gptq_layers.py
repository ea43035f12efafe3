"""GPTQ's per-layer objective at G64 on SmolLM2-135M, relative to RTN G64 (docs/log/quant.md, "GPTQ at G64").

    nice -n 10 python benchmarks/quant_gptq_layers.py

H = 2XᵀX/n for W_Q, W_up, W_down of blocks 0, 15, 29 from 16 × 256 calibration tokens through the float
model (the Apache-2.0 + GFDL-1.3 texts, as ``quant_quality.py``); for each layer tr((W − Ŵ)H(W − Ŵ)ᵀ) of
RTN G32, RTN G64, GPTQ G64 plain / with the range search (``shrink_grid=20``) / act-order / both, divided
by RTN G64's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quant_quality import rows, texts  # noqa: E402

from lmstack.inference.loader import model_tokenizer  # noqa: E402
from lmstack.model.io import load_model  # noqa: E402
from lmstack.quant.gptq import HessianAccumulator, _linears, gptq_quantize, layer_error  # noqa: E402
from lmstack.quant.int4 import dequantize_int4, quantize_int4  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    lm = load_model("smollm2-135m")
    model = lm.model.eval()
    cal = rows(model_tokenizer(lm.source).encode(texts()[1]), 16, 256)
    accs, hooks = {}, []
    for b in (0, 15, 29):
        for _, name, lin in _linears(model.blocks[b]):
            if name in ("q_proj", "up_proj", "down_proj"):
                acc = accs[(b, name)] = (HessianAccumulator(lin.in_features), lin)
                hooks.append(lin.register_forward_pre_hook(lambda m, a, acc=acc[0]: acc.add(a[0])))
    with torch.no_grad():
        for r in cal:
            model(r[None])
    for h in hooks:
        h.remove()
    print(
        "| layer | RTN G32 | RTN G64 | GPTQ G64 | + range search | act-order | act-order + range search |"
    )
    print("|---|---|---|---|---|---|---|")
    for (b, name), (acc, lin) in accs.items():
        H, W = acc.hessian(), lin.weight.detach()

        def err(t):
            return layer_error(W, dequantize_int4(*t), H)  # noqa: B023

        rtn64 = err(quantize_int4(W, 64))
        res = [err(quantize_int4(W, 32)), rtn64]
        for kw in (
            dict(),
            dict(shrink_grid=20),
            dict(act_order=True),
            dict(act_order=True, shrink_grid=20),
        ):
            res.append(err(gptq_quantize(W, H, 4, 64, **kw)))
        print(
            f"| blocks.{b}.{name} | " + " | ".join(f"{r / rtn64:.3f}" for r in res) + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
