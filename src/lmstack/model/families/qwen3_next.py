"""Qwen3NextForCausalLM: 3:1 Gated DeltaNet : gated full attention (partial RoPE, per-head QK-norm, an output
gate from a doubled q_proj), MoE with a sigmoid-gated shared expert. Qwen3-Next fuses the Gated DeltaNet
projections per head group; lmstack keeps them apart (model/deltanet.py, Qwen3.5's layout)."""

from __future__ import annotations

from typing import Any

import torch

from lmstack.model.config import MAX_SIZE, ConfigError, ModelConfig
from lmstack.model.families.base import (
    QK_NORM,
    WeightsError,
    dict_or_none,
    expect,
    flag,
    hf_int,
    hf_kinds,
    none_or_int,
    plain_theta,
    shared_expert_names,
)
from lmstack.model.families.experts import ROUTER
from lmstack.model.families.hybrid import ATTENTION_FIELDS, StrictFamily
from lmstack.model.families.qwen_moe import refuse_mlp_only_layers
from lmstack.utils import check_float, check_int

KINDS = {"gated_deltanet": "linear_attention", "attention": "full_attention"}
#: a Qwen3-Next linear_attn layer's tensors (the fused projections)
GDN = (
    "in_proj_qkvz.weight",
    "in_proj_ba.weight",
    "conv1d.weight",
    "dt_bias",
    "A_log",
    "norm.weight",
    "out_proj.weight",
)
_SPLIT = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
_KEPT = ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")


def gated_deltanet_from_qwen3_next(
    state: dict[str, torch.Tensor],
    n_k: int,
    n_v: int,
    h_k: int,
    h_v: int,
    source: str = "Qwen3-Next linear_attn",
) -> dict[str, torch.Tensor]:
    """One Qwen3-Next ``linear_attn`` layer's tensors -> ``model.deltanet.GatedDeltaNet`` names (Qwen3.5's layout).

    Qwen3-Next fuses the projections per q/k head group: ``in_proj_qkvz`` rows are, for each of the n_k groups,
    [q (h_k) | k (h_k) | v (r·h_v) | z (r·h_v)] with r = n_v / n_k, and ``in_proj_ba`` rows [b (r) | a (r)];
    lmstack (and Qwen3.5) keep [all q | all k | all v], z, b, a as separate projections. conv1d, dt_bias, A_log,
    norm and out_proj carry over. A tensor whose shape disagrees with the head sizes is a WeightsError naming it."""
    if n_v % n_k:
        raise WeightsError(
            f"{source}: n_v={n_v} value heads is not a multiple of n_k={n_k} key heads"
        )
    r = n_v // n_k
    qkvz, ba = state["in_proj_qkvz.weight"], state["in_proj_ba.weight"]
    per_group = 2 * h_k + 2 * r * h_v
    if qkvz.shape[0] != n_k * per_group:
        raise WeightsError(
            f"{source}: in_proj_qkvz.weight has {qkvz.shape[0]} rows; n_k={n_k} groups of "
            f"2·h_k + 2·(n_v/n_k)·h_v = {per_group} need {n_k * per_group}"
        )
    if ba.shape[0] != 2 * n_v:
        raise WeightsError(
            f"{source}: in_proj_ba.weight has {ba.shape[0]} rows; expected 2·n_v = {2 * n_v}"
        )
    D = qkvz.shape[1]
    q, k, v, z = qkvz.view(n_k, per_group, D).split([h_k, h_k, r * h_v, r * h_v], dim=1)
    b, a = ba.view(n_k, 2 * r, D).split([r, r], dim=1)
    out = {
        "in_proj_qkv.weight": torch.cat([q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, D)]),
        "in_proj_z.weight": z.reshape(-1, D),
        "in_proj_b.weight": b.reshape(-1, D),
        "in_proj_a.weight": a.reshape(-1, D),
    }
    for name in _KEPT:
        out[name] = state[name]
    return out


def gated_deltanet_to_qwen3_next(
    state: dict[str, torch.Tensor], n_k: int, n_v: int, h_k: int, h_v: int
) -> dict[str, torch.Tensor]:
    """The inverse of ``gated_deltanet_from_qwen3_next``: separate q/k/v, z, b, a -> fused in_proj_qkvz / in_proj_ba."""
    r = n_v // n_k
    D = state["in_proj_qkv.weight"].shape[1]
    q, k, v = state["in_proj_qkv.weight"].split([n_k * h_k, n_k * h_k, n_v * h_v])
    z, b, a = state["in_proj_z.weight"], state["in_proj_b.weight"], state["in_proj_a.weight"]
    qkvz = torch.cat(
        [
            q.view(n_k, h_k, D),
            k.view(n_k, h_k, D),
            v.reshape(n_k, r * h_v, D),
            z.reshape(n_k, r * h_v, D),
        ],
        dim=1,
    ).reshape(-1, D)
    ba = torch.cat([b.reshape(n_k, r, D), a.reshape(n_k, r, D)], dim=1).reshape(-1, D)
    out = {"in_proj_qkvz.weight": qkvz.contiguous(), "in_proj_ba.weight": ba.contiguous()}
    for name in _KEPT:
        out[name] = state[name]
    return out


class Qwen3Next(StrictFamily):
    model_type = "qwen3_next"
    hf_class = "Qwen3NextForCausalLM"
    block_names = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        **{f"attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
        **QK_NORM,
        **{f"attn.{n}": f"linear_attn.{n}" for n in _SPLIT + _KEPT},
        **{f"ffn.{w}_proj.weight": f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")},
        **ROUTER,
        "ffn.shared_gate.weight": "mlp.shared_expert_gate.weight",
        **shared_expert_names("shared_expert"),
    }
    # fused projections left by a layer missing its partner: named as missing by ``missing_hf_name``
    hf_aliases = {f"linear_attn.{n}": f"attn.{n}" for n in GDN[:2]}
    hf_fields = {
        **StrictFamily.hf_fields,
        "delta_n_heads": "linear_num_key_heads",
        "delta_n_v_heads": "linear_num_value_heads",
        "delta_head_dim": "linear_key_head_dim",
        "delta_v_head_dim": "linear_value_head_dim",
        "n_experts": "num_experts",
        "d_ff_expert": "moe_intermediate_size",
        "rotary_dim": "partial_rotary_factor",
    }
    known_fields = frozenset(
        ATTENTION_FIELDS
        | {
            "partial_rotary_factor",
            "layer_types",
            "full_attention_interval",
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "decoder_sparse_step",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "num_experts_per_tok",
            "num_experts",
            "norm_topk_prob",
            "mlp_only_layers",
            "use_sliding_window",
            "sliding_window",
            "max_window_layers",
        }
    )

    def family_fields(self, d: dict[str, Any], kw: dict[str, Any], source: str) -> dict[str, Any]:
        n = kw["n_layers"]
        att = {**self.attention_fields(d, source), "qk_norm": True}
        expect(d, "hidden_act", ("silu",), self.hf_class)
        expect(d, "use_sliding_window", (False, None), self.hf_class)
        refuse_mlp_only_layers(d, "lmstack places dense layers by decoder_sparse_step only")
        params = dict_or_none(d, "rope_parameters", source)
        theta = plain_theta(
            params or {"rope_theta": d.get("rope_theta", 10000.0)}, "rope_parameters"
        )
        factor = check_float(
            "partial_rotary_factor",
            params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)),
            ConfigError,
        )
        head_dim = att["head_dim"] or kw["d_model"] // att["n_heads"]
        every = check_int(
            "full_attention_interval", d.get("full_attention_interval", 4), ConfigError, 1, MAX_SIZE
        )
        layer_types = hf_kinds(
            d,
            n,
            {v: k for k, v in KINDS.items()},
            ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)],
        )
        shared = none_or_int(d, "shared_expert_intermediate_size")
        return dict(
            att,
            rope_theta=theta,
            rotary_dim=int(head_dim * factor),
            layer_types=layer_types,
            attn_output_gate=True,
            delta_n_heads=hf_int(d, "linear_num_key_heads"),
            delta_n_v_heads=hf_int(d, "linear_num_value_heads"),
            delta_head_dim=hf_int(d, "linear_key_head_dim"),
            delta_v_head_dim=hf_int(d, "linear_value_head_dim"),
            conv_kernel=hf_int(d, "linear_conv_kernel_dim", 4),
            n_experts=hf_int(d, "num_experts"),
            n_experts_per_token=hf_int(d, "num_experts_per_tok"),
            d_ff_expert=hf_int(d, "moe_intermediate_size"),
            router_norm_topk=flag(d, "norm_topk_prob"),
            moe_layer_step=hf_int(d, "decoder_sparse_step", 1),
            n_shared_experts=1 if shared else 0,
            d_ff_shared=shared,
            shared_expert_gate=bool(shared),
        )

    def family_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        assert c.head_dim is not None  # resolved by ModelConfig.__post_init__
        return dict(
            self.attention_to_hf(c),
            hidden_act="silu",
            layer_types=[KINDS[t] for t in c.mixer_types],
            rope_parameters={
                "rope_type": "default",
                "rope_theta": c.rope_theta,
                "partial_rotary_factor": (c.rotary_dim or c.head_dim) / c.head_dim,
            },
            linear_num_key_heads=c.delta_n_heads,
            linear_num_value_heads=c.delta_n_v_heads,
            linear_key_head_dim=c.delta_head_dim,
            linear_value_head_dim=c.delta_v_head_dim,
            linear_conv_kernel_dim=c.conv_kernel,
            num_experts=c.n_experts,
            num_experts_per_tok=c.n_experts_per_token,
            moe_intermediate_size=c.d_ff_expert,
            shared_expert_intermediate_size=c.d_ff_shared or 0,
            norm_topk_prob=c.router_norm_topk,
            decoder_sparse_step=c.moe_layer_step,
            mlp_only_layers=[],
        )

    def _heads(self, c: ModelConfig) -> tuple[int, int, int, int]:
        """(n_k, n_v, h_k, h_v) of the Gated DeltaNet layers, with ModelConfig's defaults (None = n_heads,
        = n_k, = head_dim, = h_k)."""
        n_k = c.delta_n_heads or c.n_heads
        h_k = c.delta_head_dim or c.head_dim or c.d_model // c.n_heads
        return n_k, c.delta_n_v_heads or n_k, h_k, c.delta_v_head_dim or h_k

    def prepare_hf(
        self, hf_state: dict[str, torch.Tensor], config: ModelConfig, source: str
    ) -> dict[str, torch.Tensor]:
        """Re-lay out each Gated DeltaNet layer's fused projections (model/deltanet.py's layout)."""
        for i, kind in enumerate(config.mixer_types):
            prefix = f"{self.layer_prefix}.{i}.linear_attn."
            if (
                kind != "gated_deltanet"
                or prefix + "in_proj_qkvz.weight" not in hf_state
                or prefix + "in_proj_ba.weight" not in hf_state
            ):
                continue
            layer = {
                n.removeprefix(prefix): hf_state.pop(n)
                for n in list(hf_state)
                if n.startswith(prefix)
            }
            for need in GDN:
                if need not in layer:
                    raise WeightsError(
                        f"{source}: layer {i} (gated_deltanet): missing tensor {prefix + need!r}"
                    )
            split = gated_deltanet_from_qwen3_next(
                layer,
                *self._heads(config),
                source=f"{source}: layer {i} (gated_deltanet; fields linear_num_key_heads, "
                "linear_num_value_heads, linear_key_head_dim, linear_value_head_dim)",
            )
            hf_state.update({prefix + n: t for n, t in split.items()})
        return hf_state

    def fuse(self, params: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        out = {}
        for i, kind in enumerate(config.mixer_types):
            if kind == "gated_deltanet":
                p = f"blocks.{i}.attn."
                layer = {n.removeprefix(p): params.pop(n) for n in list(params) if n.startswith(p)}
                fused = gated_deltanet_to_qwen3_next(layer, *self._heads(config))
                out.update(
                    {f"{self.layer_prefix}.{i}.linear_attn.{n}": t for n, t in fused.items()}
                )
        return out

    def missing_hf_name(self, rest: str, layer: int, config: ModelConfig) -> str:
        if rest.startswith("attn.in_proj_"):
            return "linear_attn.in_proj_qkvz.weight / in_proj_ba.weight"
        return super().missing_hf_name(rest, layer, config)
