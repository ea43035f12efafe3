"""Hand-written strategies against PyTorch's production ones (``backend="native"``): torch DDP,
FSDP2 ``fully_shard`` (fp32 and bf16 compute with fp32 master weights), DTensor TP and
ZeroRedundancyOptimizer, torch.distributed.pipelining (GPipe, 1F1B) — the same plan trained both ways gives the same numbers, and both
match single-process training."""

import torch
from parallel_helpers import OPT_KW, assert_close_params, batches, ce, reference, spawn, tiny_config


def _train(cfg, plan, data):
    from lmstack.model.transformer import Transformer
    from lmstack.parallel.interface import ParallelWrapper
    from lmstack.parallel.plan import parallelize

    model = Transformer(cfg, seed=0)
    pm = parallelize(model, plan)
    assert isinstance(pm, ParallelWrapper), type(
        pm
    )  # both backends implement the trainer's interface
    opt = pm.build_optimizer(torch.optim.AdamW, **OPT_KW)
    losses = []
    for x, y in data:
        losses.append(pm.forward_backward(x, y, ce))
        opt.step()
        opt.zero_grad()
    return pm, losses


def _native(rank, world, cases, bf16_case):
    for name, plan, cfg, data, wl, wp in cases:
        res = {}
        for backend in ("lmstack", "native"):
            pm, losses = _train(cfg, {**plan, "backend": backend}, data)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(wl), atol=1e-5, rtol=1e-5)
            got = pm.full_state_dict()
            assert_close_params(
                got,
                {k: wp[k] for k in got} if pm.pipeline is not None else wp,
                prefix=f"{name}/{backend} ",
            )
            res[backend] = (losses, pm.full_state_dict())
        torch.testing.assert_close(
            torch.tensor(res["lmstack"][0]), torch.tensor(res["native"][0]), atol=1e-6, rtol=1e-6
        )

    # bf16 compute, fp32 master shards: lmstack FullyShard vs fully_shard + MixedPrecisionPolicy
    cfg, data = bf16_case
    plan = {"dp": 2, "zero": 3, "param_dtype": "bf16"}
    pm, ours = _train(cfg, {**plan, "backend": "lmstack"}, data)
    assert all(s.dtype == torch.float32 for s in pm.fsdp.shards)
    assert pm.fsdp.units[0].buffer.dtype == torch.bfloat16
    pn, theirs = _train(cfg, {**plan, "backend": "native"}, data)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=2e-3, rtol=1e-3)
    a, b = pm.full_state_dict(), pn.full_state_dict()
    for n in b:
        assert a[n].dtype == torch.float32
        torch.testing.assert_close(a[n], b[n], atol=2e-3, rtol=1e-2, msg=lambda m: f"bf16 {n}: {m}")  # noqa: B023


def test_native_backends_agree():
    cases = []
    for name, plan, kw in [
        ("ddp", dict(dp=2), {}),
        ("zero3-tied", dict(dp=2, zero=3), dict(tie_embeddings=True)),
        ("tp", dict(tp=2), {}),
        ("zero1", dict(dp=2, zero=1), {}),
        ("pp-gpipe-tied", dict(pp=2, schedule="gpipe"), dict(tie_embeddings=True, n_layers=4)),
        ("pp-1f1b", dict(pp=2, schedule="1f1b"), dict(n_layers=4)),
    ]:
        cfg = tiny_config(**kw)
        data = batches(2, 4, 16)
        wl, wp = reference(cfg, data)
        cases.append((name, plan, cfg, data, wl, wp))
    spawn(_native, 2, cases, (tiny_config(), batches(3, 4, 16)))
