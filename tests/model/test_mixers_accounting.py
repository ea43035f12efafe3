"""Per-mixer accounting (lmstack.accounting.mixers) against the real modules and hand-worked numbers."""

import pytest
import torch

from lmstack.accounting.mixers import (
    cache_bytes,
    cache_table,
    decode_flops,
    mixer_decode_flops,
    mixer_params,
    model_params,
    plot_cache_vs_context,
)
from lmstack.inference.kv_cache import MixerCache
from lmstack.model.config import ModelConfig, repeat_pattern
from lmstack.model.transformer import Transformer

BASE = dict(
    vocab_size=64,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    ssm_head_dim=16,
    ssm_state_size=8,
    mixer_chunk_size=4,
    local_window=3,
    dsa_top_k=3,
    dsa_index_heads=2,
    dsa_index_head_dim=8,
    max_seq_len=64,
)
UNITS = [
    ["attention"],
    ["local_attention", "attention"],
    ["linear_attention", "attention"],
    ["mamba2"],
    ["gated_deltanet"] * 3 + ["attention"],
    ["dsa"],
]


def _cfg(unit, **kw):
    return ModelConfig(**{**BASE, **kw}, layer_types=repeat_pattern(unit, BASE["n_layers"]))


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: "+".join(u))
@pytest.mark.parametrize(
    "extra",
    [{}, dict(qk_norm=True, tie_embeddings=True), dict(delta_n_v_heads=8, delta_v_head_dim=6)],
)
def test_params_equal_the_modules(unit, extra):
    cfg = _cfg(unit, **extra)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model_params(cfg) == model.num_params()
    for i, block in enumerate(model.blocks):
        own = sum(
            p.numel()
            for n, p in block.attn.named_parameters()
            if not n.startswith(("q_norm", "k_norm"))
        )
        assert mixer_params(cfg, cfg.mixer_types[i]) == own


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: "+".join(u))
@pytest.mark.parametrize("S", [2, 9])
def test_cache_bytes_equal_what_the_cache_holds(unit, S):
    """After S tokens (prefill S − 1, decode 1), MixerCache.nbytes() == cache_bytes (fp32 model, fp32 states)."""
    cfg = _cfg(unit)
    model = Transformer(cfg)
    cache = MixerCache()
    tokens = torch.randint(0, 64, (1, S), generator=torch.Generator().manual_seed(S))
    with torch.no_grad():
        model(tokens[:, :-1], positions=torch.arange(S - 1), kv_cache=cache)
        model(tokens[:, -1:], positions=torch.tensor([S - 1]), kv_cache=cache)
    assert sum(cache.nbytes().values()) == cache_bytes(cfg, S, dtype="fp32")


def test_decode_flops_worked_numbers():
    cfg = _cfg(["attention"])
    # D=32 N=4 K=2 H=8. attention: projections 2·32·(2·4·8 + 2·2·8) = 6144; scores 4·4·8·S
    assert mixer_decode_flops(cfg, "attention", 100) == 6144 + 12800
    assert mixer_decode_flops(cfg, "local_attention", 100) == 6144 + 4 * 4 * 8 * 3  # W = 3 keys
    # linear, normalised: projections 2·4·32·32 = 8192; S += k vᵀ and y = Sᵀq over (8, 9): 4·4·8·9 = 1152
    assert mixer_decode_flops(cfg, "linear_attention", 100) == 9344
    # mamba2: I = 64, heads 4, conv_dim 64 + 2·8 = 80, in_proj out 64 + 80 + 4 = 148:
    # 2·32·148 + 2·64·32 + 2·80·4 + 4·4·8·16 = 9472 + 4096 + 640 + 2048
    assert mixer_decode_flops(cfg, "mamba2", 100) == 16256
    # deltanet: 4 heads of 8, conv_dim 96, value 32: 2·32·(96 + 32 + 8) + 2·32·32 + 2·96·4 + 6·4·8·8
    assert mixer_decode_flops(cfg, "gated_deltanet", 100) == 8704 + 2048 + 768 + 1536


def test_linear_mixers_flat_in_context_full_attention_linear():
    cfg = _cfg(["gated_deltanet"])
    full = _cfg(["attention"])
    assert decode_flops(cfg, 1 << 10) == decode_flops(cfg, 1 << 20)
    assert cache_bytes(cfg, 1 << 10) == cache_bytes(cfg, 1 << 20)
    assert cache_bytes(full, 2 << 20) == 2 * cache_bytes(full, 1 << 20)
    assert (
        decode_flops(full, 2048) - decode_flops(full, 1024) == 4 * 4 * 4 * 8 * 1024
    )  # L·4·N·H per extra key


def test_cache_table_and_plot(tmp_path):
    cfg = ModelConfig.from_preset("llama3-8b")
    table = cache_table(cfg, [1024, 1 << 17], window=4096)
    full, hybrid, local, linear = table.values()
    assert full[0] == 128 * 1024 * 1024  # 2·8·128·1024·32 layers·2 bytes = 128 MiB at 1k tokens
    assert hybrid[1] < full[1] / 3.9 and linear[0] == linear[1] and local[1] < full[1] / 5
    plot_cache_vs_context(cfg, [1024, 4096, 1 << 16], tmp_path / "kv.png")
    assert (tmp_path / "kv.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_cli_prints_the_cache_table_and_plot(tmp_path, capsys):
    from lmstack.cli import main

    png = tmp_path / "cache.png"
    assert main(["plan", "--model", "llama3-8b", "--batch", "1", "--mixers-plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert (
        "3:1 deltanet:full" in out and "137.44 GB" in out
    )  # full attention at 1M tokens: 2·8·128·2²⁰·32·2 B
    assert png.read_bytes()[:4] == b"\x89PNG"
