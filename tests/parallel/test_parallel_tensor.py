"""Tensor parallelism (Book of LLMs §6.6 “Megatron tensor parallelism”, CS336 notes "张量并行", "序列并行"): Megatron TP with and
without sequence parallelism trains like one process; bytes per step and per-rank bytes of
parameters, gradients and optimizer states match the accounting."""

import pytest
import torch
from parallel_helpers import (
    assert_close_params,
    batches,
    ce,
    make_opt,
    reference,
    spawn,
    tiny_config,
)


def _tensor_parallel(rank, world, cases):
    from lmstack.accounting.comm import all_gather_bytes, all_reduce_bytes, tp_layer_bytes
    from lmstack.model.transformer import Transformer
    from lmstack.parallel import collectives as C
    from lmstack.parallel.tensor import TensorParallel, vocab_parallel_cross_entropy

    for name, cfg, sp, vocab_ce, data, wl, wp in cases:
        model = Transformer(cfg, seed=0)
        plain = {k: v for k, v in vars(model.blocks[0].attn).items() if not k.startswith("_")}
        m = TensorParallel(model, None, sequence_parallel=sp, gather_output=not vocab_ce)
        # the attention module keeps its attributes (no per-rank head counts written into it)
        assert {
            k: v for k, v in vars(model.blocks[0].attn).items() if not k.startswith("_")
        } == plain
        # each rank holds 1/tp of every matrix
        if cfg.kv_lora_rank:  # MLA: the per-head up-projections split, the latent projection whole
            a = model.blocks[0].attn
            assert (
                a.kv_b_proj.weight.shape[0]
                == cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) // world
            )
            assert a.kv_a_proj.weight.shape == (
                cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                cfg.d_model,
            )
        else:
            assert model.blocks[0].attn.q_proj.weight.shape == (
                cfg.n_heads * cfg.head_dim // world,
                cfg.d_model,
            )
            assert (
                model.blocks[0].attn.k_proj.weight.shape[0]
                == cfg.n_kv_heads * cfg.head_dim // world
            )
        opt = make_opt(m.parameters())
        losses = []
        for x, y in data:
            out = m(x)
            loss = vocab_parallel_cross_entropy(out, y, None) if vocab_ce else ce(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(wl), atol=1e-5, rtol=1e-5)
        assert_close_params(m.full_state_dict(), wp, prefix=name + " ")

    # bytes: L layers × (2 all-reduces forward + 2 backward) of (B, S, D), plus the embedding's
    # forward all-reduce, the final norm's backward all-reduce and the logits' all-gather over V
    for sp in (False, True):
        cfg = tiny_config()
        model = Transformer(cfg, seed=0)
        m = TensorParallel(model, None, sequence_parallel=sp)
        B, S = 2, 8
        x, y = batches(1, B, S)[0]
        with C.count_bytes() as c:
            ce(m(x), y).backward()
        act = B * S * cfg.d_model * 4
        want = (
            cfg.n_layers * tp_layer_bytes(cfg, B, S, world, "fp32")
            + 2 * all_reduce_bytes(act, world)
            + all_gather_bytes(B * S * cfg.vocab_size * 4, world)
        )
        if sp:  # the replicated norm weights see S/tp tokens: their gradients are all-reduced
            want += (2 * cfg.n_layers + 1) * all_reduce_bytes(cfg.d_model * 4, world)
        assert c.total == pytest.approx(want), (sp, c.total, want)
        if (
            not sp
        ):  # per-rank bytes of parameters, gradients, AdamW states == the accounting's tp row
            from lmstack.accounting.memory import training_memory_per_device

            opt = make_opt(m.parameters())
            opt.step()
            mem = training_memory_per_device(cfg, B, S, "tp", world, mixed_precision=False)
            measured = {
                "master_weights": sum(p.numel() * 4 for p in m.parameters()),
                "gradients": sum(p.grad.numel() * 4 for p in m.parameters()),
                "optimizer": sum(
                    v.numel() * v.element_size()
                    for st in opt.state.values()
                    for k, v in st.items()
                    if k != "step"
                ),
            }
            for k, v in measured.items():
                assert v == pytest.approx(getattr(mem, k)), (k, v, getattr(mem, k))

    with pytest.raises(ValueError, match="n_kv_heads=1 is not divisible by tp=2"):
        TensorParallel(Transformer(tiny_config(n_kv_heads=1), seed=0), None)


def test_tensor_and_sequence_parallel_match_single_process():
    cases = []
    for name, kw, sp, vocab_ce in [
        ("tp-gqa", {}, False, False),
        ("tp-tied-qknorm-vocabce", dict(tie_embeddings=True, qk_norm=True), False, True),
        ("sp-qkvbias", dict(qkv_bias=True), True, False),
        ("sp-tied-qknorm-vocabce", dict(tie_embeddings=True, qk_norm=True), True, True),
        # a hybrid: the linear-attention layer shards what its spec declares (q/k/v by heads, o row-parallel)
        (
            "tp-linear-attention-hybrid",
            dict(layer_types=["attention", "linear_attention"], mixer_chunk_size=4),
            False,
            False,
        ),
        # MLA (its spec's plan): q / kv_b column, o row, the latent projections replicated; compressed q with SP
        (
            "tp-mla",
            dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
            False,
            False,
        ),
        (
            "sp-mla-compressed-q",
            dict(
                kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
            ),
            True,
            False,
        ),
    ]:
        cfg = tiny_config(**kw)
        data = batches(2, 2, 16)
        wl, wp = reference(cfg, data)
        cases.append((name, cfg, sp, vocab_ce, data, wl, wp))
    spawn(_tensor_parallel, 2, cases)
