"""``lmstack plan``'s numbers: everything accounting knows about one model, device and workload.

A plan is a plain dict (JSON-ready) built only from the pure functions of this package, so what
the CLI prints, what ``--json`` writes and what the tests check are the same numbers.
"""

from __future__ import annotations

from lmstack.accounting import comm, flops, intensity, memory, params, roofline
from lmstack.accounting.hardware import Hardware
from lmstack.accounting.precision import bytes_per_element, canonical_dtype
from lmstack.model.config import ModelConfig
from lmstack.model.mixer_spec import layer_specs


def build_plan(
    cfg: ModelConfig,
    hw: Hardware,
    batches: list[int],
    S: int,
    dtype: object = "bf16",
    devices: int = 8,
    train_batch: int | None = None,
    step_time_s: float | None = None,
) -> dict:
    """Tables for B in ``batches`` at context length S on ``hw`` (weights, KV, activations in ``dtype``)."""
    if not batches or any(b < 1 for b in batches):
        raise ValueError(f"batches={batches!r}: need one or more batch sizes >= 1")
    if S < 1:
        raise ValueError(f"S={S} must be >= 1")
    dt = canonical_dtype(dtype)
    pc = params.param_counts(cfg)
    out: dict = {
        "model": {
            "name": cfg.name,
            "V": cfg.vocab_size,
            "D": cfg.d_model,
            "L": cfg.n_layers,
            "N": cfg.n_heads,
            "K": cfg.n_kv_heads,
            "G": cfg.group_size,
            "H": cfg.head_dim,
            "F": cfg.d_ff,
            "tie_embeddings": cfg.tie_embeddings,
            "sliding_window": cfg.sliding_window,
        },
        "hardware": {
            "name": hw.name,
            "peak_flops": hw.flops(dt),
            "hbm_bandwidth": hw.hbm_bandwidth,
            "hbm_bytes": hw.hbm_bytes,
            "sram_bytes": hw.sram_bytes,
            "ridge_point": hw.ridge_point(dt),
            "source": hw.source,
        },
        "workload": {
            "batches": list(batches),
            "S": S,
            "dtype": dt,
            "bytes_per_element": bytes_per_element(dt),
        },
        "params": {**pc.to_dict(), "seed001_param": params.matmul_params(cfg)},
    }
    out["decode"] = [p.to_dict() for p in roofline.decode_sweep(cfg, hw, batches, S, dt)]
    out["prefill"] = [roofline.prefill_point(cfg, hw, b, S, dt).to_dict() for b in batches]
    mem_rows = []
    for b in batches:
        with_fa = memory.inference_memory(cfg, b, S, dt, flash=True, window=cfg.sliding_window)
        without = memory.inference_memory(cfg, b, S, dt, flash=False, window=cfg.sliding_window)
        mem_rows.append(
            {
                "B": b,
                "weights": with_fa.weights,
                "kv_cache": with_fa.kv_cache,
                "activations_flash": with_fa.activations,
                "activations_no_flash": without.activations,
                "total_flash": with_fa.total,
                "total_no_flash": without.total,
                "fits_flash": with_fa.total <= hw.hbm_bytes,
                "fits_no_flash": without.total <= hw.hbm_bytes,
            }
        )
    out["inference_memory"] = mem_rows
    out["kv_cache_variants_B1"] = memory.kv_cache_variants(cfg, 1, S, dt)
    out["intensity"] = [{"B": b, **intensity.phase_verdicts(cfg, hw, b, S, dt)} for b in batches]
    out["flops"] = {
        "forward_per_sequence": flops.forward_flops(cfg, 1, S),
        "training_step_per_sequence": flops.training_step_flops(cfg, 1, S),
        **flops.six_nd_vs_exact(cfg, 1, S),
        "attention_share": {
            str(s): flops.attention_share(cfg, 1, s) for s in sorted({512, 2048, 8192, 32768, S})
        },
    }
    M = devices
    tb = train_batch or M
    train = {}
    for strat in memory.STRATEGIES:
        for ckpt in (False, True):
            m = memory.training_memory_per_device(cfg, tb, S, strat, M, flash=True, checkpoint=ckpt)
            train[f"{strat}{'+ckpt' if ckpt else ''}"] = {
                **m.to_dict(),
                "fits": m.total <= hw.hbm_bytes,
            }
    out["training_per_device"] = {"M": M, "B": tb, "S": S, "flash": True, "strategies": train}
    if step_time_s is not None:
        step = flops.training_step_flops(cfg, tb, S)
        out["training_per_device"].update(
            step_flops=step,
            step_time_s=step_time_s,
            mfu=flops.mfu(step, step_time_s, hw.flops(dt), M),
        )
    P = pc.total
    commrows = {}
    link = "nvlink" if hw.nvlink_bandwidth else None
    for strat in ("ddp", "zero1", "zero2", "zero3"):
        sent = comm.data_parallel_step_bytes(P, M, strat, "bf16")
        row = {"bytes_sent_per_device": sent}
        if link:
            row["time_s_nvlink"] = comm.collective_time(sent, hw.link_bandwidth(link))
        commrows[strat] = row
    out["communication"] = {
        "M": M,
        "data_parallel": commrows,
        "tp_layer_bytes_per_device": comm.tp_layer_bytes(cfg, 1, S, M, "bf16"),
        "tp_compute_comm_ratio": comm.tp_compute_comm_ratio(cfg.d_model, M),
    }
    # mixture of experts / MLA (model/moe.py, model/mla.py: the layers whose spec caches a latent)
    if cfg.n_experts or any(s.cache == "latent" for s in layer_specs(cfg)):
        tokens = tb * S
        out["moe"] = {
            **params.moe_summary(cfg),
            "six_n_active_per_token": flops.six_nd(params.active_params(cfg), 1),
            "six_n_total_per_token": flops.six_nd(params.total_params(cfg), 1),
            "kv_bytes_per_token": memory.kv_cache_bytes(cfg, 1, 1, dt),
            "kv_bytes_per_token_gqa_equivalent": 2
            * cfg.n_heads
            * (cfg.v_head_dim or cfg.head_dim)
            * cfg.n_layers
            * bytes_per_element(dt),
            "ep": M,
            "all_to_all_bytes_per_step_per_device": comm.moe_all_to_all_bytes(
                cfg, tokens // M, M, dt
            ),
        }
    return out
