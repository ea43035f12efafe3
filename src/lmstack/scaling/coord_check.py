"""The µP coordinate check (Yang et al. 2022, Tensor Programs V §D.1): train models of growing width
for a few AdamW steps at one learning rate and record the typical size of activations (mean |x| per
coordinate) at each step. Under SP the logits and hidden states grow with width after the first
updates; under µP the curves lie on top of each other. Book of LLMs §3.1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.scaling.mup import apply_mup, mup_param_groups
from lmstack.train.losses import cross_entropy
from lmstack.train.optim import AdamW
from lmstack.utils import pyplot, save_png

SITES = ("embedding", "last block", "logits")


def _model(width: int, n_heads: int, n_layers: int, vocab: int, seq: int) -> Transformer:
    cfg = ModelConfig.from_dict(
        dict(
            d_model=width,
            n_layers=n_layers,
            n_heads=n_heads,
            d_ff=4 * width,
            vocab_size=vocab,
            max_seq_len=seq,
            tie_embeddings=False,
            name=f"w{width}",
        )
    )
    return Transformer(cfg, seed=0)


def coord_check(
    widths: list[int],
    base_width: int,
    parametrization: str,
    steps: int = 5,
    lr: float = 1e-2,
    n_heads: int = 4,
    n_layers: int = 2,
    vocab: int = 256,
    batch: int = 8,
    seq: int = 32,
    seed: int = 0,
) -> dict[int, np.ndarray]:
    """{width: (steps + 1, len(SITES)) mean |activation|} at steps 0..``steps`` (before each update)."""
    if parametrization not in ("sp", "mup"):
        raise ValueError(f"parametrization={parametrization!r}; expected 'sp' or 'mup'")
    gen = torch.Generator().manual_seed(seed)
    # a learnable stream: each token is the previous one + 1 (mod V), with 10% noise
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    tokens = (start + torch.arange(seq + 1)) % vocab
    noise = torch.rand(tokens.shape, generator=gen) < 0.1
    tokens = torch.where(noise, torch.randint(0, vocab, tokens.shape, generator=gen), tokens)
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = {}
    for w in widths:
        model = _model(w, n_heads, n_layers, vocab, seq)
        if parametrization == "mup":
            groups = mup_param_groups(model, apply_mup(model, base_width, seed), 0.0)
            for g in groups:
                g["lr"] = lr * g.pop("lr_scale")
        else:
            groups = [{"params": list(model.parameters()), "lr": lr}]
        opt = AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        acts: dict[str, float] = {}

        def record(site: str):
            return lambda module, inputs, output: acts.__setitem__(  # noqa: B023
                site, float(output.detach().abs().mean())
            )

        hooks = [
            model.embed.register_forward_hook(record("embedding")),
            model.blocks[-1].register_forward_hook(record("last block")),
        ]
        rows = []
        for t in range(steps + 1):
            logits = model(x)  # (B, S, V)
            rows.append(
                [acts["embedding"], acts["last block"], float(logits.detach().abs().mean())]
            )
            if t == steps:
                break
            loss, _ = cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        for h in hooks:
            h.remove()
        out[w] = np.array(rows)
    return out


def plot_coord_check(results: dict[str, dict[int, np.ndarray]], path: Path) -> Path:
    """One row per parametrization, one column per site: mean |x| vs width, one line per step."""
    plt = pyplot()

    fig, axes = plt.subplots(
        len(results), len(SITES), figsize=(4 * len(SITES), 3.2 * len(results)), squeeze=False
    )
    for r, (name, res) in enumerate(results.items()):
        widths = sorted(res)
        steps = res[widths[0]].shape[0]
        for c, site in enumerate(SITES):
            ax = axes[r][c]
            for t in range(steps):
                ax.plot(
                    widths,
                    [res[w][t, c] for w in widths],
                    "-o",
                    ms=3,
                    label=f"t={t}",
                    color=plt.get_cmap("viridis")(t / max(1, steps - 1)),
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name.upper()}: {site}")
            ax.set_xlabel("width d_model")
            if c == 0:
                ax.set_ylabel("mean |x|")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    return path
