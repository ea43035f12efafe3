"""µP (Maximal Update Parametrization) for the lmstack Transformer and AdamW, relative to a base width.

Book of LLMs §3.1 “muP”: hyperparameters tuned on a small model do not transfer under the standard
parametrization (SP), because different layers' updates grow differently with width; µP sets each
layer's init variance and learning rate so the update relative to the weight stays the same at every
width. The rules are Yang et al. 2022, "Tensor Programs V" (µTransfer), Table 3 (Adam column), with
fan_in measured against the base model (at the base width µP equals SP, so a tuned SP base transfers):

    kind                     init variance         AdamW LR      forward
    input (embedding)        σ²                    η             -
    hidden (q,k,v,o,FFN)     σ²·base_fan_in/fan_in η·base/fan_in -
    output (unembedding)     σ²·(base/fan_in)²     η·base/fan_in (as the 1/m output multiplier below)
    vectors (norms, biases)  1 / 0                 η             -
    attention scores         q·k / H instead of q·k / √H (times √H_base so the base is unchanged)

How it reaches the model without changing ``lmstack.model`` (every change is a re-scaling of stored
tensors plus the matching per-group LR, exact for Adam, whose update ignores the gradient's scale):

- output multiplier 1/m (m = D/D_base): logits = W_U·(γ ⊙ x̂)/m, so the final RMSNorm gain γ is stored
  as 1/m with LR ×1/m. The unembedding keeps σ and η, so a tied embedding (input rules) is consistent:
  the effective output weight W_U/m has variance σ²/m² and update η/m, the table's output row;
- attention 1/H: q_proj (or the q-norm gain under QK-norm) is stored ×c, c = √(H_base/H), with LR ×c
  and weight decay ÷c (AdamW decays by lr·λ), so the scores are q·k·√H_base/H;
- hidden init/LR: the re-initialisation below and the per-group ``lr_scale`` the LR schedule honours.

``MupTrainer`` is the Trainer with these groups: ``MupTrainer(config, base_width=64).fit()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.train.config import TrainConfig
from lmstack.train.trainer import Trainer, optimizer_class

KINDS = ("input", "hidden", "output", "vector")


@dataclass(frozen=True)
class MupParam:
    """How µP treats one parameter tensor (the stored tensor, after the re-scalings above)."""

    name: str
    kind: str  # input | hidden | output | vector
    init_std: float  # std of the stored matrix (0 for vectors)
    init_value: float  # value of a vector's entries (norm gains; biases 0)
    lr_mult: float  # × the schedule's lr (the group's lr_scale)
    wd_mult: float  # × weight_decay (matrices only)
    fan_in: int
    base_fan_in: int


def width_ratio(config: ModelConfig, base_width: int) -> float:
    if not (isinstance(base_width, int) and base_width > 0):
        raise ValueError(
            f"base_width={base_width!r} must be a positive integer (the d_model of the tuned base model)"
        )
    return config.d_model / base_width


def base_config(config: ModelConfig, base_width: int) -> ModelConfig:
    """The base model: d_model = base_width with the same layers and heads (H = base_width / N, the head
    dimension grows with width, where 1/H attention matters) and d_ff scaled by the same ratio."""
    m = width_ratio(config, base_width)
    if config.head_dim is not None and config.head_dim * config.n_heads != config.d_model:
        raise ValueError(
            f"µP here scales H = D/N with width; head_dim={config.head_dim} is set apart from "
            f"d_model/n_heads = {config.d_model / config.n_heads:g}"
        )
    if base_width % config.n_heads:
        raise ValueError(f"base_width={base_width} is not divisible by n_heads={config.n_heads}")
    d = config.to_dict()
    d.update(d_model=base_width, d_ff=max(1, round(config.d_ff / m)), head_dim=None)
    return ModelConfig.from_dict(d)


def mup_table(model: nn.Module, base_width: int) -> list[MupParam]:
    """The µP row of every parameter of ``model`` (names as in ``named_parameters``)."""
    cfg: ModelConfig = model.config
    base = base_config(cfg, base_width)
    base_params = dict(_shapes(base))
    m = width_ratio(cfg, base_width)
    sigma = cfg.init_std
    H, H_base = cfg.head_dim, base.head_dim
    c_attn = math.sqrt(H_base / H)
    rows = []
    for name, p in model.named_parameters():
        if name not in base_params:
            raise ValueError(
                f"parameter {name!r} has no counterpart in the base model (d_model={base_width})"
            )
        if p.dim() == 1:
            value = 0.0 if name.endswith("bias") else 1.0
            lr = 1.0
            if name == "norm.weight":  # the output multiplier 1/m lives in the final gain
                value, lr = 1.0 / m, 1.0 / m
            elif cfg.qk_norm and name.endswith("q_norm.weight"):
                value, lr = c_attn, c_attn
            rows.append(
                MupParam(name, "vector", 0.0, value, lr, 1.0, p.shape[0], base_params[name][0])
            )
            continue
        fan_in, base_fan_in = p.shape[1], base_params[name][1]
        sp_std = (
            sigma / math.sqrt(2 * cfg.n_layers)
            if name.endswith(("o_proj.weight", "down_proj.weight"))
            else sigma
        )
        if name == "embed.weight":  # (V, D): its fan_in is the vocabulary, which does not grow
            rows.append(
                MupParam(name, "input", sigma, 0.0, 1.0, 1.0, p.shape[0], base_params[name][0])
            )
        elif name == "lm_head.weight":
            rows.append(MupParam(name, "output", sigma, 0.0, 1.0, 1.0, fan_in, base_fan_in))
        else:
            r = base_fan_in / fan_in
            std, lr, wd = sp_std * math.sqrt(r), r, 1.0
            if name.endswith("q_proj.weight") and not cfg.qk_norm:
                std, lr, wd = std * c_attn, lr * c_attn, 1.0 / c_attn
            rows.append(MupParam(name, "hidden", std, 0.0, lr, wd, fan_in, base_fan_in))
    return rows


def _shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:

    with torch.device("meta"):
        model = Transformer(cfg, device="meta")
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@torch.no_grad()
def apply_mup(model: nn.Module, base_width: int, seed: int = 0) -> list[MupParam]:
    """Re-initialise ``model`` by its µP table (truncated normal at ±3σ, like ``init_weights``)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    table = mup_table(model, base_width)
    params = dict(model.named_parameters())
    for row in table:
        p: Tensor = params[row.name]
        if row.kind == "vector":
            p.fill_(row.init_value)
        else:
            cpu = torch.empty(p.shape, dtype=torch.float32)
            nn.init.trunc_normal_(
                cpu, 0.0, row.init_std, -3 * row.init_std, 3 * row.init_std, generator=gen
            )
            p.copy_(cpu)
    return table


def mup_param_groups(model: nn.Module, table: list[MupParam], weight_decay: float) -> list[dict]:
    """One AdamW group per distinct (lr_mult, decay): ``lr_scale`` is what ``LRSchedule.apply`` multiplies."""
    params = dict(model.named_parameters())
    groups: dict[tuple[float, float], list[Tensor]] = {}
    for row in table:
        wd = 0.0 if row.kind == "vector" else weight_decay * row.wd_mult
        groups.setdefault((row.lr_mult, wd), []).append(params[row.name])
    return [{"params": ps, "lr_scale": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()]


class MupTrainer(Trainer):
    """``Trainer`` whose model is µP-initialised and whose AdamW groups carry the µP LR multipliers."""

    def __init__(self, config: TrainConfig, base_width: int, **kw):
        if config.parallel:
            raise ValueError("MupTrainer runs in one process; parallel plans are not supported")
        if config.optimizer != "adamw":
            raise ValueError(
                f"optimizer={config.optimizer!r}: the µP multipliers here are AdamW's (TP V Table 3)"
            )
        self.base_width = base_width
        self.mup_rows: list[MupParam] | None = None
        super().__init__(config, **kw)

    def build_optimizer(self) -> torch.optim.Optimizer:
        if self.mup_rows is None:
            self.mup_rows = apply_mup(self.raw_model, self.base_width, self.config.seed)
        cls, kw = optimizer_class(self.config)
        opt = cls(mup_param_groups(self.raw_model, self.mup_rows, self.config.weight_decay), **kw)
        for g in opt.param_groups:  # the first step's lr before the schedule sets it
            g["lr"] = kw["lr"] * g["lr_scale"]
        return opt
