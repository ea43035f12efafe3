"""fp16 gradients underflow without loss scaling; bf16's do not (Book of LLMs §5 “numeric precision”), on SmolLM2-135M.

    nice -n 10 python benchmarks/quant_fp16_underflow.py [--tokens 128] [--plot docs/quant_fp16_underflow.png]

One backward of the next-token loss on ``--tokens`` tokens of the GPL-3 text (or stdlib source) with
the whole model in fp32 (the reference), in fp16 with the loss unscaled, in fp16 with dynamic loss
scaling (start 2^16, halve on inf/NaN, as ``DynamicLossScaler``), and in bf16. For each: the fraction
of weight-gradient elements that are zero where fp32's are not, and the relative error ‖g − g32‖/‖g32‖.
The PNG shows the histogram of log2|g32| with fp16's smallest subnormal (2⁻²⁴) and normal (2⁻¹⁴).
"""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from lmstack.inference.loader import model_tokenizer
from lmstack.model.io import load_model
from lmstack.quant.loss_scale import DynamicLossScaler


def grads(model, tokens, dtype, scaler: DynamicLossScaler | None = None):
    m = copy.deepcopy(model).to(dtype).train()
    while True:
        m.zero_grad(set_to_none=True)
        logits = m(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        (scaler.scale(loss) if scaler else loss).backward()
        g = torch.cat([p.grad.float().flatten() for p in m.parameters()])
        if scaler is None:
            return g, None
        g = g / scaler.scale_value
        if torch.isfinite(g).all():
            return g, scaler.scale_value
        scaler.update(found_inf=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m")
    tok = model_tokenizer(lm.source)
    lic = Path("/usr/share/common-licenses/GPL-3")
    text = lic.read_text() if lic.is_file() else Path(os.__file__).read_text()
    tokens = torch.tensor([tok.encode(text)[: args.tokens + 1]])
    g32, _ = grads(lm.model, tokens, torch.float32)
    nz = g32 != 0
    rows = [("fp32", g32, None)]
    rows.append(("fp16, no loss scaling", *grads(lm.model, tokens, torch.float16)))
    rows.append(
        (
            "fp16, dynamic loss scaling",
            *grads(lm.model, tokens, torch.float16, DynamicLossScaler(2.0**16)),
        )
    )
    rows.append(("bf16", *grads(lm.model, tokens, torch.bfloat16)))
    print(
        f"{int(nz.sum())} non-zero fp32 gradient elements of {g32.numel()}; "
        f"{float((g32[nz].abs() < 2**-24).float().mean()):.1%} of them below fp16's smallest subnormal 2^-24, "
        f"{float((g32[nz].abs() < 2**-14).float().mean()):.1%} below its smallest normal 2^-14"
    )
    print(
        "| gradients | loss scale | zero where fp32 is not | ‖g − g32‖ / ‖g32‖ |\n|---|---|---|---|"
    )
    for name, g, s in rows:
        lost = float(((g == 0) & nz).float().sum() / nz.sum())
        err = float((g - g32).norm() / g32.norm())
        print(
            f"| {name} | {'—' if s is None else f'2^{int(torch.log2(torch.tensor(s)))}'} | {lost:.2%} | {err:.4f} |"
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        ax.hist(torch.log2(g32[nz].abs()).numpy(), bins=120, color="gray")
        for x, label in (
            (-24, "fp16 smallest subnormal 2^-24"),
            (-14, "fp16 smallest normal 2^-14"),
        ):
            ax.axvline(x, color="red" if x == -24 else "orange", linestyle="--", label=label)
        ax.set_xlabel("log2 |gradient| (fp32 backward, SmolLM2-135M)")
        ax.set_ylabel("elements")
        ax.legend()
        tmp = Path(args.plot).with_suffix(".tmp.png")
        fig.tight_layout()
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, args.plot)


if __name__ == "__main__":
    main()
