"""2-D compositions through ``parallelize(model, plan)`` on 4 ranks (CS336 notes "混合并行"):
DP×TP (with and without SP), ZeRO-2×TP, ZeRO-3×TP, DP×PP, ZeRO-1×PP (zero-bubble), DP×CP,
TP×PP (tied embeddings across stages, vocab shards gathered on the last stage), TP×CP, and
DP×TP / ZeRO-3×TP / DP×PP with tied and frozen parameters (split and replicated ones) and
gradient accumulation — each matches single-process training on the whole batch."""

import pytest
import torch
from parallel_helpers import OPT_KW, assert_close_params, batches, ce, reference, spawn, tiny_config


def _compose(rank, world, cases):
    from lmstack.model.transformer import Transformer
    from lmstack.parallel.plan import parallelize

    for name, plan, cfg, data, wl, wp, accum, freeze in cases:
        model = Transformer(cfg, seed=0)
        for n, p in model.named_parameters():
            if n in freeze:
                p.requires_grad_(False)
        pm = parallelize(model, plan)
        opt = pm.build_optimizer(torch.optim.AdamW, **OPT_KW)
        losses, i = [], 0
        while i < len(data):
            tot = 0.0
            for a in range(accum):  # gradient accumulation: DDP under no_sync but for the last
                x, y = data[i]
                i += 1
                tot += pm.forward_backward(
                    x,
                    y,
                    lambda logits, t: ce(logits, t) / accum,  # noqa: B023
                    no_sync=pm.ddp is not None and a < accum - 1,
                )
            opt.step()
            opt.zero_grad()
            losses.append(tot)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(wl), atol=1e-5, rtol=1e-5)
        got = pm.full_state_dict()
        assert got
        assert_close_params(
            got, {k: wp[k] for k in got} if pm.pipeline is not None else wp, prefix=name + " "
        )


@pytest.mark.slow
def test_two_dimensional_compositions():
    cases = []
    for name, plan, kw, accum, freeze in [
        ("dp x tp", dict(dp=2, tp=2), {}, 1, ()),
        ("dp x tp+sp", dict(dp=2, tp=2, sequence_parallel=True), dict(tie_embeddings=True), 1, ()),
        ("zero2 x tp", dict(dp=2, tp=2, zero=2), {}, 1, ()),
        ("zero3 x tp", dict(dp=2, tp=2, zero=3), {}, 1, ()),
        ("dp x pp", dict(dp=2, pp=2, schedule="1f1b"), dict(n_layers=4), 1, ()),
        (
            "zero1 x pp zb",
            dict(dp=2, pp=2, zero=1, schedule="zb"),
            dict(n_layers=4, tie_embeddings=True),
            1,
            (),
        ),
        ("dp x cp", dict(dp=2, cp=2), {}, 1, ()),
        (
            "tp x pp",
            dict(tp=2, pp=2, schedule="1f1b"),
            dict(n_layers=4, tie_embeddings=True),
            1,
            (),
        ),
        ("tp x cp", dict(tp=2, cp=2), dict(qk_norm=True), 1, ()),
        # tied + frozen (a column-parallel, a row-parallel and a replicated parameter) + accumulation
        (
            "dp x tp tied frozen accum",
            dict(dp=2, tp=2),
            dict(tie_embeddings=True),
            2,
            ("blocks.0.attn.q_proj.weight", "blocks.1.ffn.down_proj.weight", "norm.weight"),
        ),
        (
            "zero3 x tp tied frozen accum",
            dict(dp=2, tp=2, zero=3),
            dict(tie_embeddings=True),
            2,
            ("blocks.0.attn.k_proj.weight", "blocks.1.ffn_norm.weight"),
        ),
        (
            "dp x pp zb tied frozen",
            dict(dp=2, pp=2, schedule="zb"),
            dict(n_layers=4, tie_embeddings=True),
            1,
            ("blocks.3.attn.v_proj.weight", "blocks.0.ffn.gate_proj.weight"),
        ),
    ]:
        cfg = tiny_config(**kw)
        data = batches(2 * accum, 8, 16)
        wl, wp = reference(cfg, data, accum=accum, freeze=freeze)
        cases.append((name, plan, cfg, data, wl, wp, accum, freeze))
    spawn(_compose, 4, cases)


def test_plan_errors_name_the_bad_value():
    from lmstack.parallel.plan import ParallelPlan, get_parallelize

    with pytest.raises(ValueError, match="zero=3 with pp>1"):
        ParallelPlan(zero=3, pp=2)
    with pytest.raises(ValueError, match="unknown key 'pq'"):
        get_parallelize({"pq": 2})
    for spec in (
        {"dp": 2, "tp": 2, "zero": 1},
        {"pp": 2},
        "zero3",
        {"cp": 2},
        {"dp": 2, "backend": "native"},
    ):
        get_parallelize(spec)  # accepted: the trainer has the hooks for every strategy
