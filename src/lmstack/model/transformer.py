"""The decoder-only Transformer: embedding, L pre-norm blocks, final norm, unembedding.

Book of LLMs §1.2 (the layer-by-layer forward pass), CS336 notes "模型架构" (pre-norm, no biases),
"层并行" (the GPT-J parallel block). The model knows nothing about caches, sharding or
kernels beyond the seams it exposes: ``kv_cache`` and ``positions`` in ``forward``, and the
attention / RMSNorm implementations set once by the builder (``set_attention``, ``set_norm``;
``lmstack.kernels.runtime.configure`` resolves a ``RuntimeConfig`` into them).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from lmstack.model.attention import Attention
from lmstack.model.config import ModelConfig
from lmstack.model.dsa import dsa_loss_coefs
from lmstack.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, SwiGLU, linear
from lmstack.model.mixer_spec import layer_softcap, layer_specs
from lmstack.model.mixers import build_mixer, init_recurrent_parameters
from lmstack.model.moe import moe_from_config, moe_loss_coefs, moe_metrics, update_router_biases
from lmstack.model.seam import AttentionImpl, AttentionMetadata, NormImpl, supports_softcap
from lmstack.model.variants import GeGLU, OffsetRMSNorm, make_norm


def aux_loss_coefs(config: ModelConfig) -> dict[str, float]:
    """The config fields that weight the auxiliary losses this model's layers add in training (field -> value):
    DSA's indexer KL (``dsa_indexer_loss``), the MoE routers' balance / device-balance / z terms. Read from the
    config alone, so every pipeline stage answers the same whatever layers it holds."""
    return {**dsa_loss_coefs(config), **moe_loss_coefs(config)}


def token_mixer(config: ModelConfig, layer_idx: int, rope: RotaryEmbedding, **kw) -> nn.Module:
    """Layer ``layer_idx``'s token mixer: ``(x (B, T, D), meta: AttentionMetadata) -> (B, T, D)``.

    The layer's kind (``model.mixer_spec.layer_kinds``: ``config.layer_types``, softmax attention by default, MLA
    in an MLA model) is one declared spec (``mixer_spec.SPECS``); ``model.mixers.build_mixer`` builds its module
    (softmax attention with its variants, MLA, local/linear attention, Mamba-2, Gated DeltaNet, DSA).
    """
    return build_mixer(config, layer_idx, rope, **kw)


def channel_mixer(config: ModelConfig, layer_idx: int, **kw) -> nn.Module:
    """Layer ``layer_idx``'s feed-forward: ``(B, T, D) -> (B, T, D)``; today the dense SwiGLU
    (CS336 notes "模型架构"). Mixture-of-experts layers are chosen here from the config."""
    if config.is_moe_layer(layer_idx):  # mixture of experts: model.moe
        return moe_from_config(config, **kw)
    if config.ffn_act == "gelu_tanh":  # Gemma's GeGLU: model.variants
        return GeGLU(config.d_model, config.d_ff, **kw)
    return SwiGLU(config.d_model, config.d_ff, **kw)


class Block(nn.Module):
    """One Transformer layer.

    Sequential (default):  h = x + Attn(Norm_attn(x));  y = h + FFN(Norm_ffn(h))
    Parallel (GPT-J):      y = x + Attn(Norm(x)) + FFN(Norm(x))   — one shared norm.
    Sandwich (Gemma-2/3, ``sandwich_norm``): each branch's output is normed too before the residual add.
    Mixer only (Mamba2, ``block_ffn=False``): y = x + Mixer(Norm(x)).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rope: RotaryEmbedding,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        self.parallel = config.parallel_block
        self.attn_norm = make_norm(config, config.d_model, **kw)  # γ_attn
        self.attn = token_mixer(config, layer_idx, rope, **kw)
        ffn = config.block_ffn
        self.ffn_norm = (
            None if self.parallel or not ffn else make_norm(config, config.d_model, **kw)
        )  # γ_ffn
        self.ffn = channel_mixer(config, layer_idx, **kw) if ffn else None
        sandwich = config.sandwich_norm
        self.post_attn_norm = make_norm(config, config.d_model, **kw) if sandwich else None
        self.post_ffn_norm = make_norm(config, config.d_model, **kw) if sandwich and ffn else None

    def channel(self, h: Tensor, meta: AttentionMetadata) -> Tensor:
        """The feed-forward on h (B, T, D); one that routes on the token itself (a hash-routed MoE,
        ``reads_token_ids``) also gets the input token ids from ``meta``."""
        assert self.ffn is not None  # called only on blocks with a feed-forward
        if getattr(self.ffn, "reads_token_ids", False):
            return self.ffn(h, token_ids=meta.token_ids)
        return self.ffn(h)

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        # x: (B, T, D) -> (B, T, D)
        if self.parallel:
            h = self.attn_norm(x)
            return x + self.attn(h, meta) + self.channel(h, meta)
        if self.post_attn_norm is None and self.ffn is not None:  # the Llama block
            x = x + self.attn(self.attn_norm(x), meta)
            assert self.ffn_norm is not None  # sequential blocks with an FFN have γ_ffn
            return x + self.channel(self.ffn_norm(x), meta)
        h = self.attn(self.attn_norm(x), meta)
        x = x + (h if self.post_attn_norm is None else self.post_attn_norm(h))
        if self.ffn is None:
            return x
        assert self.ffn_norm is not None  # sequential blocks with an FFN have γ_ffn
        h = self.channel(self.ffn_norm(x), meta)
        return x + (h if self.post_ffn_norm is None else self.post_ffn_norm(h))


class Transformer(nn.Module):
    """Token ids (B, S) -> logits (B, S, V).

    Construct on the meta device (``with torch.device("meta"): Transformer(cfg)``) to count
    parameters or to plan sharding without allocating; ``to_empty(device=...)`` then
    ``init_weights()`` or a weight load makes it real.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 0,
    ):
        super().__init__()
        self.config = config
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        self.embed = Embedding(config.vocab_size, config.d_model, **kw)  # W_e (V, D)
        assert config.head_dim is not None  # resolved by ModelConfig.__post_init__
        self.rope = RotaryEmbedding(
            config.head_dim, config.max_seq_len, config.rope_theta, config.rope_layout
        )
        self.blocks = nn.ModuleList(
            Block(config, i, self.rope, **kw) for i in range(config.n_layers)
        )
        self.norm = make_norm(config, config.d_model, **kw)  # γ_final
        # W_u (V, D); with tied embeddings the unembedding *is* W_e.
        self.lm_head = (
            None if config.tie_embeddings else Linear(config.d_model, config.vocab_size, **kw)
        )
        # Activation checkpointing (Book of LLMs §1.8 “training memory”): recompute each block's activations in backward.
        self.activation_checkpointing = False
        if self.embed.weight.device.type != "meta":
            self.init_weights(seed)

    def ropes(self) -> list[RotaryEmbedding]:
        """The RoPE tables this model reads: the shared one and any a layer keeps of its own (Gemma-3's local
        base and linear scaling, Qwen3-Next's partial RoPE: ``VariantAttention._own_rope``)."""
        own = [r for b in self.blocks for r in (getattr(b.attn, "_own_rope", None) or ())]
        return [self.rope, *own]

    # ---- weights -------------------------------------------------------------------------
    @property
    def unembedding(self) -> Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def unembed(self, x: Tensor) -> Tensor:
        """Final-normed hidden states (..., D) -> logits (..., V). The untied unembedding is a module
        call, so ``lmstack.quant`` can swap in a quantised one; tied, it is W_e itself. Gemma-2's final
        soft-cap (``final_softcap``: c·tanh(z / c)) is part of it, so every caller that unembeds hidden
        states itself (the engine, perplexity, scoring) gets the model's real logits."""
        logits = (
            self.lm_head(x) if self.lm_head is not None else linear(x, self.embed.weight)
        )  # tied: W_e
        cap = self.config.final_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Seeded initialisation, independent of the global RNG:

        - embedding and every linear weight: truncated normal N(0, σ²) cut at ±3σ, σ = init_std;
        - the two residual-branch outputs per block (W_O and W_down): σ / sqrt(2L), so the
          variance the residual stream accumulates over 2L branches stays O(σ²) (GPT-2 scheme);
        - biases 0; RMSNorm γ = 1 (w = 0 for the (1 + w) norms of ``norm_offset`` models);
        - the recurrent mixers' decay / Δ / D / conv parameters: their reference values
          (``mixers.init_recurrent_parameters``, seeded with ``seed``).
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)

        def trunc(t: Tensor, s: float) -> None:
            cpu = torch.empty(t.shape, dtype=torch.float32)
            nn.init.trunc_normal_(cpu, mean=0.0, std=s, a=-3 * s, b=3 * s, generator=gen)
            t.copy_(cpu)

        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "norm" in name:
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                trunc(p, residual_std)
            else:
                trunc(p, std)
        for m in self.modules():
            if isinstance(m, OffsetRMSNorm):
                m.reset_parameters()
        init_recurrent_parameters(self, seed)

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embedding else n

    def _softmax_blocks(self) -> list[tuple[int, nn.Module]]:
        """(layer index, block) of the blocks whose mixer runs an AttentionImpl (``MixerSpec.softmax``); a pipeline
        stage holds a slice of the layers, so the index is the mixer's own ``layer_idx``."""
        specs = layer_specs(self.config)
        out = []
        for i, block in enumerate(self.blocks):
            layer = getattr(block.attn, "layer_idx", i)
            if specs[layer].softmax:
                out.append((layer, block))
        return out

    def attention_needs(self) -> tuple[str, ...]:
        """What an attention implementation must honour for this model: ``("softcap",)`` when a layer soft-caps its
        scores (Gemma-2's ``attn_softcap``; ``seam.supports_softcap``), else ()."""
        capped = any(layer_softcap(self.config, i) is not None for i, _ in self._softmax_blocks())
        return ("softcap",) if capped else ()

    def set_attention(self, impl: AttentionImpl) -> None:
        """Run every layer's attention through ``impl`` (``lmstack.kernels.backends`` registers them);
        layers whose mixer is not softmax attention over a KV cache (``config.layer_types``) keep theirs.
        An implementation that cannot apply what a layer needs (soft-capped scores) is refused by name, before
        anything is set."""
        capped = [i for i, _ in self._softmax_blocks() if layer_softcap(self.config, i) is not None]
        if capped and not supports_softcap(impl):
            raise ValueError(
                f"attention backend {getattr(impl, 'name', type(impl).__name__)!r} does not apply "
                f"attention-logit soft-capping (attn_softcap={self.config.attn_softcap} in layers "
                f"{capped}); use one that does: 'reference' (or attn_backend='auto')"
            )
        for _, block in self._softmax_blocks():
            cast(Attention, block.attn).impl = impl  # every softmax mixer has ``impl``

    @property
    def attention(self) -> AttentionImpl | None:
        """The implementation the softmax-attention layers run (None when no layer is softmax attention)."""
        return next((cast(Attention, b.attn).impl for _, b in self._softmax_blocks()), None)

    def set_norm(self, impl: NormImpl | None) -> None:
        """Run every RMSNorm through ``impl`` (None: the eager formula in ``model.layers``)."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.impl = impl

    def fuse_projections(self) -> int:
        """Fuse each attention's q/k/v and each SwiGLU's gate/up into one GEMM (runtime-side: checkpoints and
        ``state_dict`` are unchanged, the separate weights become views of the fused ones); returns how many
        modules were fused. For inference: call it after the model is placed and converted."""
        return sum(bool(m.fuse()) for m in self.modules() if isinstance(m, (Attention, SwiGLU)))

    # ---- training hooks: what the trainer asks the model, knowing no kind of layer ----------
    def aux_losses(self) -> dict[str, Tensor]:
        """Named auxiliary loss terms of the last training forward, each weighted by its coefficient
        (``aux_loss_coefs``) and summed over the layers that produce it: ``dsa_indexer_loss`` (DSA's indexer
        KL, model/dsa.py), ``moe_aux_loss`` (the MoE routers' balance terms, model/moe.py). A layer takes
        part by having ``aux_losses() -> {name: scalar}``; {} after an inference or evaluation forward."""
        parts: dict[str, list[Tensor]] = {}
        for m in self.modules():
            own = getattr(m, "aux_losses", None) if m is not self else None
            if callable(own):
                for name, t in own().items():
                    parts.setdefault(name, []).append(t)
        return {n: torch.stack([t.float() for t in ts]).sum() for n, ts in parts.items()}

    def training_metrics(self) -> dict[str, float]:
        """Statistics the layers recorded in the last training forward, for the step's metrics: the MoE
        routers' expert loads, dropped assignments and balance terms (``moe.moe_metrics``); {} otherwise."""
        return moe_metrics(self)

    def after_optimizer_step(self) -> None:
        """State that moves after each optimizer step without a gradient: aux-loss-free router biases
        (DeepSeek-V3) step toward balance at ``config.moe_bias_update_rate`` from the last loads."""
        if self.config.moe_bias_update_rate:
            update_router_biases(self, self.config.moe_bias_update_rate)

    # ---- forward -------------------------------------------------------------------------
    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        kv_cache=None,
        last_n: int | None = None,
        document_ids: Tensor | None = None,
        return_hidden: bool = False,
    ) -> Tensor:
        """tokens: (B, S) int64; positions: (B, S) or (S,) absolute positions (default 0..S-1).

        A model may hold a slice of the layers (a pipeline stage): without ``embed`` it takes
        hidden states (B, S, D) in place of tokens; without ``norm`` it returns hidden states.

        ``kv_cache``: see ``lmstack.model.attention`` — stores keys/values across calls.
        ``last_n``: compute logits only for the last n positions (decoding needs 1).
        ``document_ids``: (B, S) ids of packed documents; attention never crosses documents
        (pass positions that restart at 0 in each document for per-document RoPE).
        ``return_hidden``: return the final-normed hidden states (B, S, D) instead of the logits,
        for a loss that applies the unembedding itself (``lmstack.train.losses.linear_cross_entropy``).
        Returns logits (B, S, V), or (B, last_n, V).
        """
        if tokens.dim() != (2 if self.embed is not None else 3):
            want = (
                "(B, S)"
                if self.embed is not None
                else "(B, S, D) hidden states (this model has no embedding)"
            )
            raise ValueError(f"tokens must have shape {want}, got {tuple(tokens.shape)}")
        B, S = tokens.shape[:2]
        is_causal = (
            positions is None and kv_cache is None
        )  # 0..S-1 on every row: the causal triangle
        if positions is None:
            if kv_cache is not None:
                raise ValueError("positions are required when a kv_cache is passed")
            positions = torch.arange(S, device=tokens.device)  # (S,)
        elif positions.shape[-1] != S:
            raise ValueError(
                f"positions shape {tuple(positions.shape)} does not match tokens {(B, S)}"
            )
        if document_ids is not None and document_ids.shape != (B, S):
            raise ValueError(
                f"document_ids shape {tuple(document_ids.shape)} does not match tokens {(B, S)}"
            )
        for rope in self.ropes():  # once per forward: every layer's attention only rotates
            rope.cover(positions)
        meta = AttentionMetadata(
            positions,
            document_ids=document_ids,
            window=self.config.sliding_window,
            is_causal=is_causal,
            cache=kv_cache,
            token_ids=tokens if self.embed is not None else None,
        )
        x = self.embed(tokens) if self.embed is not None else tokens  # (B, S, D)
        if self.config.embed_scale and self.embed is not None:  # Gemma: W_e[tokens]·√D
            x = x * torch.tensor(self.config.d_model**0.5, dtype=x.dtype)
        checkpoint = self.activation_checkpointing and torch.is_grad_enabled() and kv_cache is None
        for block in self.blocks:
            if checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, meta, use_reentrant=False)
            else:
                x = block(x, meta)
        if self.norm is None:
            return x  # (B, S, D): the next stage's input
        if last_n is not None:
            x = x[:, -last_n:]
        x = self.norm(x)
        if return_hidden:
            return x  # (B, S, D)
        return self.unembed(x)  # (B, S, V)
