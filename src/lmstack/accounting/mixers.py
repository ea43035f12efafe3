"""Per-mixer accounting: parameters, decode FLOPs per token, and cache bytes per sequence (KV or state).

CS336 notes "注意力机制" (linear attention, Mamba-2, Gated DeltaNet, hybrids, DSA: O(n²) → O(n)),
"推理时注意力开销" (one full-attention layer in four or six); Book of LLMs §1.9 “sliding-window and sparse attention”, §2.5 (a local layer keeps W
positions). The formulas are each mixer's spec (``lmstack.model.mixer_spec``); for one sequence at context S,
layer by layer (``mixer_spec.layer_kinds``):

  attention           KV 2·K·H·S elements          FLOPs/token  proj + 4·N·H·S
  local_attention     KV 2·K·H·min(S, W)            proj + 4·N·H·min(S, W)
  dsa                 KV 2·K·H·S + indexer keys H_I·S     proj + indexer 2·n_I·H_I·S + 4·N·H·min(S, k)
  linear_attention    state N·H·(H+1) (normalised)     proj + 4·N·H·(H+1)             — flat in S
  mamba2              state heads·N_state·P + conv (K_c−1)·conv_dim     proj + conv + 4·heads·N_state·P
  gated_deltanet      state n_v·H_k·H_v + conv (K_c−1)·conv_dim         proj + conv + 6·n_v·H_k·H_v

Recurrent states are kept in fp32 (``model.linear_scan``), KV and conv inputs in the model dtype,
exactly as ``inference.kv_cache.MixerCache`` holds them (its ``nbytes()`` equals ``cache_bytes`` —
tests/model/test_mixers_accounting.py). Parameter counts equal the modules' ``numel`` sums
(tests/model/test_mixer_spec.py).
"""

from __future__ import annotations

from lmstack.accounting.flops import forward_flops
from lmstack.accounting.params import total_params
from lmstack.accounting.precision import bytes_per_element
from lmstack.model.config import ModelConfig, repeat_pattern
from lmstack.model.mixer_spec import layer_kinds, spec
from lmstack.utils import pyplot, save_png

STATE_DTYPE = "fp32"


def mixer_params(c: ModelConfig, kind: str) -> int:
    """Parameters of one layer's token mixer of ``kind`` (its norm gammas counted under norms, as in params.py):
    the kind's ``model.mixer_spec.MixerSpec.params``."""
    return spec(kind).params(c)


def model_params(c: ModelConfig) -> int:
    """All parameters of the lmstack Transformer for ``c`` with its per-layer mixers (= ``params.total_params``)."""
    return total_params(c)


def mixer_decode_flops(c: ModelConfig, kind: str, S: int) -> int:
    """Forward FLOPs of one layer's mixer for one new token at context S: 2 per multiply-add of the
    projections, the short convolution and the state/score products (biases, norms and elementwise gates
    not counted)."""
    return sum(spec(kind).flops(c, 1, 1, S, None))


def mixer_cache_bytes(
    c: ModelConfig, kind: str, S: int, dtype: object = "bf16", state_dtype: object = STATE_DTYPE
) -> float:
    """Bytes one layer keeps for one sequence after S tokens: KV (model dtype) or state (fp32) + conv inputs."""
    return spec(kind).cache_bytes(c, S, bytes_per_element(dtype), bytes_per_element(state_dtype))


def cache_bytes(c: ModelConfig, S: int, B: int = 1, dtype: object = "bf16") -> float:
    """KV + state bytes of the whole model for B sequences at context S."""
    return B * sum(mixer_cache_bytes(c, kind, S, dtype) for kind in layer_kinds(c))


def decode_flops(c: ModelConfig, S: int) -> int:
    """Forward FLOPs of all mixers + FFNs + unembedding for one token at context S (``flops.forward_flops``, T = 1)."""
    return forward_flops(c, 1, S, T=1)


def pattern_variants(c: ModelConfig, window: int = 4096) -> dict[str, ModelConfig]:
    """The seed's comparison for one model size: full attention, 3:1 Gated-DeltaNet:full, 5:1 local:global
    (window W), and pure Gated DeltaNet (head sizes from ``c``)."""

    def rep(unit):
        return repeat_pattern(unit, c.n_layers)

    return {
        "full": c.replace(layer_types=None),
        "3:1 deltanet:full": c.replace(layer_types=rep(["gated_deltanet"] * 3 + ["attention"])),
        f"5:1 local({window}):global": c.replace(
            layer_types=rep(["local_attention"] * 5 + ["attention"]), local_window=window
        ),
        "pure deltanet": c.replace(layer_types=rep(["gated_deltanet"])),
    }


def cache_table(
    c: ModelConfig, contexts: list[int], dtype: object = "bf16", window: int = 4096
) -> dict[str, list[float]]:
    """{variant: [KV+state bytes at each S]} for ``pattern_variants``."""
    return {
        name: [cache_bytes(v, S, 1, dtype) for S in contexts]
        for name, v in pattern_variants(c, window).items()
    }


def plot_cache_vs_context(
    c: ModelConfig, contexts: list[int], path, dtype: object = "bf16", window: int = 4096
) -> None:
    """PNG: KV + state bytes per sequence vs context length (log-log) for the four layer patterns."""
    plt = pyplot()

    table = cache_table(c, contexts, dtype, window)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ys in table.items():
        ax.plot(contexts, [y / 2**20 for y in ys], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length S (tokens)")
    ax.set_ylabel(f"KV + state per sequence (MiB, {dtype})")
    ax.set_title(f"{c.name}: L={c.n_layers}, D={c.d_model}, K={c.n_kv_heads}, H={c.head_dim}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_png(fig, path, dpi=120)
