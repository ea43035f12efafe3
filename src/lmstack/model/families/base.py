"""What every HF family adapter shares: the ``Family`` base class, the HF field readers, the Llama-layout
name tables and the per-expert <-> stacked expert tensors (as torchtitan's state-dict adapters).

A family translates both ways, config and weights: ``config_from_hf`` (an HF ``config.json`` dict ->
ModelConfig), ``config_to_hf``, ``state_from_hf`` (HF tensors -> lmstack names) and ``state_to_hf``. The
name tables are data on the class (``top_names``, ``block_names``: lmstack name -> HF name, read in both
directions); a family whose tensors do not map one to one overrides the ``prepare_hf`` / ``fuse`` hooks.
"""

from __future__ import annotations

import re
from typing import Any, cast

import torch

from lmstack.model.config import MAX_SIZE, ConfigError, ModelConfig
from lmstack.utils import check_bool, check_float, check_int


class WeightsError(ValueError):
    """A weights file that is missing, truncated, corrupted or does not fit the model."""


LM_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
#: the FFN weights that are (E, out, in) stacks in an MoE layer
EXPERT_PARAMS = ("ffn.gate_proj.weight", "ffn.up_proj.weight", "ffn.down_proj.weight")


# ---- HF config fields: each reader's ConfigError names the field ------------------------------
def dict_or_none(d: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    v = d.get(key)
    if v is not None and not isinstance(v, dict):
        raise ConfigError(
            f"{source}: {key}={v!r} must be an object (or null), got {type(v).__name__}"
        )
    return v or {}


def rope_theta(d: dict[str, Any], source: str) -> float:
    """Θ of plain RoPE from ``rope_parameters`` / ``rope_scaling`` / ``rope_theta``; scaling is refused."""
    params = dict_or_none(d, "rope_parameters", source)
    scaling = dict_or_none(d, "rope_scaling", source) or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type not in ("default", None):
        raise ConfigError(
            f"{source}: rope scaling type {rope_type!r} is not supported (only plain RoPE)"
        )
    key = "rope_parameters.rope_theta" if "rope_theta" in params else "rope_theta"
    return check_float(key, params.get("rope_theta", d.get("rope_theta", 10000.0)), ConfigError)


def plain_theta(params: dict[str, Any], where: str) -> float:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
        raise ConfigError(
            f"{where}.rope_type={kind!r} is not supported (only plain RoPE, 'default')"
        )
    return check_float(f"{where}.rope_theta", params.get("rope_theta", 10000.0), ConfigError)


def first_id(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if isinstance(v, list):
        v = v[0] if v else None
    return None if v is None else check_int(key, v, ConfigError, minimum=0)


def flag(d: dict[str, Any], key: str) -> bool:
    """An HF boolean field; absent or null is False."""
    v = d.get(key)
    return False if v is None else check_bool(key, v, ConfigError)


def hf_int(d: dict[str, Any], key: str, default: int | None = None, maximum: int = MAX_SIZE) -> int:
    """A positive HF integer field; absent (or null, for fields with a default) is ``default``."""
    if key not in d and default is None:
        raise ConfigError(f"missing required field {key!r}")
    v = d.get(key)
    return check_int(
        key, default if v is None and default is not None else v, ConfigError, 1, maximum
    )


def none_or_int(d: dict[str, Any], key: str) -> int | None:
    return None if d.get(key) is None else check_int(key, d[key], ConfigError, 1, MAX_SIZE)


def expect(d: dict[str, Any], key: str, allowed: tuple, family: str) -> None:
    """A field this loader supports only at the values ``allowed`` (absent counts as the first)."""
    v = d.get(key, allowed[0])
    if v not in allowed:
        raise ConfigError(
            f"{key}={v!r} is not supported by lmstack's {family} loader (expected one of {allowed})"
        )


def hf_kinds(d: dict[str, Any], n: int, table: dict[str, str], default: list[str]) -> list[str]:
    """HF ``layer_types`` (or ``default`` when absent) -> lmstack mixers via ``table``; refuses unknown kinds."""
    kinds = d.get("layer_types") or default
    if not isinstance(kinds, list) or len(kinds) != n:
        raise ConfigError(
            f"layer_types={kinds!r:.80} must list one kind for each of num_hidden_layers={n} layers"
        )
    for i, t in enumerate(kinds):
        if t not in table:
            raise ConfigError(
                f"layer_types[{i}]={t!r} (layer {i}); expected one of {sorted(table)}"
            )
    return [table[t] for t in kinds]


def name_of(d: dict[str, Any], model_type: str) -> str:
    name = d.get("_name_or_path") or model_type
    return name if isinstance(name, str) else model_type


# ---- the Llama layout (model.layers.{i}.self_attn / mlp) ---------------------------------------
LLAMA_BLOCK = {  # lmstack name inside blocks.{i}  ->  HF name inside model.layers.{i}
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn.{p}_proj.{w}": f"self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")},
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    **{f"ffn.{w}_proj.weight": f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")},
}
LLAMA_TOP = {  # lmstack top-level name -> HF
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
QK_NORM = {f"attn.{p}_norm.weight": f"self_attn.{p}_norm.weight" for p in "qk"}


def shared_expert_names(hf_module: str) -> dict[str, str]:
    """The always-on shared expert (DeepSeekMoE ``shared_experts``, Qwen-MoE ``shared_expert``)."""
    return {
        f"ffn.shared.{w}_proj.weight": f"mlp.{hf_module}.{w}_proj.weight"
        for w in ("gate", "up", "down")
    }


# ---- experts: per-expert HF tensors <-> one (E, out, in) stack per layer and weight -------------
_HF_EXPERT = re.compile(
    r"(?:model|backbone)\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+?)(?:_proj)?\.weight"
)


def stack_experts(
    family: Family, hf_state: dict[str, torch.Tensor], config: ModelConfig, source: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
    """Per-expert HF tensors ``...experts.{j}.{w}.weight`` -> (the other HF tensors, the stacked ones under
    lmstack names ``blocks.{i}.ffn.{w}_proj.weight``, their HF name patterns). A missing expert is a
    WeightsError naming the layer, the weight, the experts absent and ``n_experts``."""
    hf_w = {v: k for k, v in family.expert_weights.items()}  # HF weight name -> gate | up | down
    groups: dict[tuple[int, str], dict[int, tuple[str, torch.Tensor]]] = {}
    rest = {}
    for name, t in hf_state.items():
        m = _HF_EXPERT.fullmatch(name)
        if m is None:
            rest[name] = t
            continue
        w = hf_w.get(m.group(3), m.group(3))
        groups.setdefault((int(m.group(1)), w), {})[int(m.group(2))] = (name, t)
    E = config.n_experts
    stacked, hf_names = {}, {}
    for i in (i for i in range(config.n_layers) if config.is_moe_layer(i)):
        for w in ("gate", "up", "down"):
            got = groups.pop((i, w), {})
            missing = sorted(set(range(E)) - set(got))
            extra = sorted(set(got) - set(range(E)))
            if missing or extra:
                what = (
                    f"missing for experts {missing[:8]}"
                    if missing
                    else f"present for experts {extra[:8]}"
                )
                raise WeightsError(
                    f"{source}: layer {i} expert weight {w}_proj is {what}, but the config says "
                    f"n_experts={E} (experts 0..{E - 1})"
                )
            F, D = config.d_ff_expert or config.d_ff, config.d_model
            want = (D, F) if w == "down" else (F, D)
            for n, t in got.values():  # torch.stack would promote an int32 expert and name none
                if not t.is_floating_point() or tuple(t.shape) != want:
                    raise WeightsError(
                        f"{source}: tensor {n!r} has dtype {t.dtype}, shape {tuple(t.shape)}; "
                        f"expected a floating-point dtype, shape {want} (d_model={D}, d_ff_expert={F})"
                    )
            name = f"blocks.{i}.ffn.{w}_proj.weight"
            stacked[name] = torch.stack([got[j][1] for j in range(E)])
            hf_names[name] = family.expert_name(i, "*", w)
    if groups:
        (i, w), _ = next(iter(groups.items()))
        raise WeightsError(
            f"{source}: layer {i} holds expert weights ({w}_proj), but the config makes it a dense "
            f"layer (moe_first_dense={config.moe_first_dense}, moe_layer_step={config.moe_layer_step})"
        )
    return rest, stacked, hf_names


class Family:
    """One HF model family (``model_type``): its config and its tensor names, both ways.

    Subclasses set the class attributes and implement ``config_from_hf`` / ``config_to_hf``; the state
    dict translation is the tables' unless a family overrides its hooks.
    """

    model_type: str = ""  # HF config.json "model_type"
    hf_class: str = ""  # HF "architectures"[0]
    layer_prefix: str = "model.layers"  # HF layer {i} lives under f"{layer_prefix}.{i}."
    top_names: dict[str, str] = LLAMA_TOP  # lmstack top-level name -> HF name
    #: lmstack name inside blocks.{i} -> HF name inside the layer (read both ways)
    block_names: dict[str, str] = LLAMA_BLOCK
    #: other HF names inside a layer, read as an lmstack name (load only)
    hf_aliases: dict[str, str] = {}
    expert_module: str = "mlp"  # routed experts: f"{layer}.{expert_module}.experts.{j}.{weight}"
    expert_weights: dict[str, str] = {w: f"{w}_proj" for w in ("gate", "up", "down")}
    #: a missing tensor or a wrong shape is named by its HF name, layer, mixer kind and sizing fields
    explain_errors: bool = False

    #: ModelConfig fields -> the HF fields they are read from (named in ModelConfig's own errors)
    hf_fields: dict[str, str] = {
        "vocab_size": "vocab_size",
        "d_model": "hidden_size",
        "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads",
        "n_kv_heads": "num_key_value_heads",
        "d_ff": "intermediate_size",
        "max_seq_len": "max_position_embeddings",
        "norm_eps": "rms_norm_eps",
        "n_experts_per_token": "num_experts_per_tok",
    }

    # ---- config ------------------------------------------------------------------------------
    def name_hf_fields(self, message: str) -> str:
        """``message`` (a ModelConfig error, in lmstack's field names) with the HF fields they came from."""
        named = [
            f"{lm} is {hf}"
            for lm, hf in self.hf_fields.items()
            if lm != hf and re.search(rf"\b{lm}=", message)
        ]
        return f"{message} (HF fields: {', '.join(named)})" if named else message

    def config_from_hf(self, d: dict[str, Any], source: str) -> ModelConfig:
        raise NotImplementedError

    def config_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        raise NotImplementedError

    # ---- names -------------------------------------------------------------------------------
    def expert_name(self, layer: int, expert: int | str, w: str) -> str:
        return (
            f"{self.layer_prefix}.{layer}.{self.expert_module}.experts.{expert}."
            f"{self.expert_weights[w]}.weight"
        )

    def lmstack_name(self, name: str) -> str | None:
        """lmstack name of an HF tensor; None for tensors lmstack does not use; KeyError if unknown."""
        top = {v: k for k, v in self.top_names.items()}
        if name in top:
            return top[name]
        if name.endswith("rotary_emb.inv_freq"):
            return None
        layer, _, rest = name.removeprefix(self.layer_prefix + ".").partition(".")
        if name.startswith(self.layer_prefix + ".") and layer.isdigit():
            table = {**{v: k for k, v in self.block_names.items()}, **self.hf_aliases}
            if rest in table:
                return f"blocks.{int(layer)}.{table[rest]}"
        raise KeyError(name)

    def hf_name(self, name: str) -> str:
        """HF name of an lmstack parameter (not a stacked expert weight); KeyError if it has none."""
        if name in self.top_names:
            return self.top_names[name]
        m = LM_BLOCK.fullmatch(name)
        if m and m.group(2) in self.block_names:
            return f"{self.layer_prefix}.{m.group(1)}.{self.block_names[m.group(2)]}"
        raise KeyError(
            f"lmstack parameter {name!r} has no HF name in a {self.model_type} checkpoint"
        )

    # ---- state dicts -------------------------------------------------------------------------
    def prepare_hf(
        self, hf_state: dict[str, torch.Tensor], config: ModelConfig, source: str
    ) -> dict[str, torch.Tensor]:
        """Hook: HF tensors before their names are mapped (drop extra layers, re-lay out fused ones)."""
        return hf_state

    def fuse(self, params: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """Hook: pop the lmstack parameters the family stores fused and return them under HF names."""
        return {}

    def state_from_hf(
        self, hf_state: dict[str, torch.Tensor], config: ModelConfig, source: str
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """HF tensors -> (lmstack-named tensors, lmstack name -> the HF name it came from)."""
        state: dict[str, torch.Tensor] = {}
        hf_names: dict[str, str] = {}
        hf_state = self.prepare_hf(dict(hf_state), config, source)
        if config.n_experts:
            hf_state, state, hf_names = stack_experts(self, hf_state, config, source)
        for name, t in hf_state.items():
            try:
                lm = self.lmstack_name(name)
            except KeyError:
                raise WeightsError(
                    f"{source}: unexpected tensor {name!r} for a {config.architecture} model"
                ) from None
            if lm is not None:
                state[lm], hf_names[lm] = t, name
        return state, hf_names

    def state_to_hf(
        self, params: dict[str, torch.Tensor], config: ModelConfig
    ) -> dict[str, torch.Tensor]:
        """lmstack parameters (detached, on the CPU) -> HF-named tensors, experts one tensor each."""
        params = dict(params)
        out = self.fuse(params, config)
        for n, t in params.items():
            m = LM_BLOCK.fullmatch(n)
            if m and m.group(2) in EXPERT_PARAMS and config.is_moe_layer(int(m.group(1))):
                w = m.group(2).split(".")[1].removesuffix("_proj")
                i = int(m.group(1))
                out.update(
                    {self.expert_name(i, j, w): t[j].contiguous() for j in range(t.shape[0])}
                )
            else:
                out[self.hf_name(n)] = t.contiguous()
        return out

    def missing_hf_name(self, rest: str, layer: int, config: ModelConfig) -> str:
        """The HF name (inside its layer) of a missing lmstack parameter ``blocks.{layer}.{rest}``."""
        if rest in EXPERT_PARAMS and config.is_moe_layer(layer):
            return f"mlp.experts.*.{rest.split('.')[1]}.weight"
        return self.block_names.get(rest, rest)

    def check_state(
        self,
        model: torch.nn.Module,
        state: dict[str, torch.Tensor],
        hf_names: dict[str, str],
        source: str,
    ) -> None:
        """With ``explain_errors``: a missing tensor or a wrong shape is a WeightsError naming the layer, its
        mixer kind, the HF tensor, both shapes and the config fields that size it (``load_state_into`` then
        checks the rest, under lmstack names)."""
        if not self.explain_errors:
            return
        config = cast(ModelConfig, model.config)
        kinds = config.mixer_types
        params = dict(model.named_parameters())
        missing = [n for n in params if n not in state]
        if missing:
            m = LM_BLOCK.fullmatch(missing[0])
            if m is None:
                raise WeightsError(
                    f"{source}: missing tensor {self.top_names.get(missing[0], missing[0])!r}"
                )
            i = int(m.group(1))
            raise WeightsError(
                f"{source}: layer {i} ({kinds[i]}): missing tensor "
                f"'{self.layer_prefix}.{i}.{self.missing_hf_name(m.group(2), i, config)}'"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        for name, p in params.items():
            t = state.get(name)
            if t is None or tuple(t.shape) == tuple(p.shape):
                continue
            m = LM_BLOCK.fullmatch(name)
            where = f"layer {m.group(1)} ({kinds[int(m.group(1))]})" if m else "top level"
            fields = SHAPE_FIELDS.get(m.group(2) if m else "", "vocab_size, hidden_size")
            raise WeightsError(
                f"{source}: {where}: tensor {hf_names.get(name, name)!r} has shape {tuple(t.shape)}, "
                f"but the config makes it {tuple(p.shape)} (fields: {fields})"
            )


#: which HF config fields size each tensor (for shape-mismatch errors); keys are lmstack names inside a block
SHAPE_FIELDS = {
    "attn.in_proj.weight": "hidden_size, expand, n_groups, state_size, num_heads",
    "attn.conv1d.weight": "conv_kernel (linear_conv_kernel_dim) and the conv channels (expand·hidden_size + "
    "2·n_groups·state_size, or 2·key heads·key dim + value heads·value dim)",
    "attn.conv1d.bias": "expand, hidden_size, n_groups, state_size",
    "attn.dt_bias": "num_heads (linear_num_value_heads)",
    "attn.A_log": "num_heads (linear_num_value_heads)",
    "attn.D": "num_heads",
    "attn.norm.weight": "expand·hidden_size (linear_value_head_dim)",
    "attn.out_proj.weight": "hidden_size, expand (linear_num_value_heads·linear_value_head_dim)",
    "attn.q_proj.weight": "num_attention_heads, head_dim, hidden_size",
    "attn.k_proj.weight": "num_key_value_heads, head_dim, hidden_size",
    "attn.v_proj.weight": "num_key_value_heads, head_dim, hidden_size",
    "attn.o_proj.weight": "hidden_size, num_attention_heads, head_dim",
    "attn.q_norm.weight": "head_dim",
    "attn.k_norm.weight": "head_dim",
    "attn.in_proj_qkv.weight": "linear_num_key_heads, linear_key_head_dim, linear_num_value_heads, "
    "linear_value_head_dim",
    "attn.in_proj_z.weight": "linear_num_value_heads, linear_value_head_dim",
    "attn.in_proj_b.weight": "linear_num_value_heads",
    "attn.in_proj_a.weight": "linear_num_value_heads",
    "ffn.gate_proj.weight": "intermediate_size / moe_intermediate_size, num_experts",
    "ffn.up_proj.weight": "intermediate_size / moe_intermediate_size, num_experts",
    "ffn.down_proj.weight": "intermediate_size / moe_intermediate_size, num_experts",
    "ffn.router.weight": "num_experts",
    "ffn.shared_gate.weight": "hidden_size",
    "ffn.shared.gate_proj.weight": "shared_expert_intermediate_size",
    "ffn.shared.up_proj.weight": "shared_expert_intermediate_size",
    "ffn.shared.down_proj.weight": "shared_expert_intermediate_size",
}
