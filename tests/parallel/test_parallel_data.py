"""Data parallelism (Book of LLMs §6.4 “DDP and ZeRO”): DDP (naive, bucketed-overlapped, no_sync), ZeRO-1/2/3 train
like one process on the whole batch; bytes per step and per-rank memory match the accounting."""

import torch
import torch.distributed as dist
from parallel_helpers import (
    OPT_KW,
    assert_close_params,
    batches,
    ce,
    make_opt,
    reference,
    spawn,
    tiny_config,
)

from lmstack.model.transformer import Transformer


def _train(rank, world, build, data, accum=1, freeze=()):
    """Each rank takes its B/M rows; ``build(model) -> (runner, optimizer, wrapper)``."""
    from lmstack.model.transformer import Transformer

    model = Transformer(data["cfg"], seed=rank)  # different per rank: the broadcast must fix it
    for n, p in model.named_parameters():
        if n in freeze:
            p.requires_grad_(False)
    runner, opt, wrapper = build(model)
    losses, i = [], 0
    seq = data["batches"]
    while i < len(seq):
        tot = 0.0
        for a in range(accum):
            x, y = seq[i]
            xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
            sync = a == accum - 1
            ctx = wrapper.no_sync() if (not sync and hasattr(wrapper, "no_sync")) else _null()
            with ctx:
                loss = ce(runner(xs), ys) / accum
                loss.backward()
            t = loss.detach().clone()
            dist.all_reduce(t)
            tot += float(t) / world
            i += 1
        opt.step()
        opt.zero_grad()
        losses.append(tot)
    return model, runner, opt, losses


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _data_parallel(rank, world, cases):
    from lmstack.accounting.comm import data_parallel_step_bytes
    from lmstack.accounting.memory import training_memory_per_device
    from lmstack.parallel import collectives as C
    from lmstack.parallel.ddp import DataParallel, broadcast_module
    from lmstack.parallel.zero import FullyShard, ZeroOptimizer

    def ddp(mode):
        def build(model):
            m = DataParallel(model, mode=mode, bucket_mb=0.01)  # several buckets on a tiny model
            return m, make_opt([p for p in model.parameters() if p.requires_grad]), m

        return build

    def zero(stage):
        def build(model):
            from lmstack.train.optim import AdamW  # any optimizer class: lmstack's own for ZeRO-1

            broadcast_module(model)
            opt = ZeroOptimizer(
                [p for p in model.parameters() if p.requires_grad],
                AdamW if stage == 1 else torch.optim.AdamW,
                stage=stage,
                **OPT_KW,
            )
            return model, opt, opt

        return build

    def zero3(model):
        m = FullyShard(model)
        return m, make_opt(m.parameters()), m

    builders = {
        "naive": ddp("naive"),
        "bucketed": ddp("bucketed"),
        "zero1": zero(1),
        "zero2": zero(2),
        "zero3": zero3,
    }
    for name, strategy, data, accum, freeze, want_losses, want_params in cases:
        model, runner, opt, losses = _train(rank, world, builders[strategy], data, accum, freeze)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(want_losses), atol=1e-5, rtol=1e-5
        )
        got = (
            runner.full_state_dict()
            if strategy == "zero3"
            else {n: p.detach() for n, p in model.named_parameters()}
        )
        assert_close_params(got, want_params, prefix=f"{name} ")
        if strategy == "bucketed":  # buckets went out while backward was still running
            steps = len(data["batches"]) // accum
            assert len(runner.buckets) > 2
            assert runner.launched_during_backward >= steps * (len(runner.buckets) - 1)
        # every replica ends identical
        for p in runner.parameters() if strategy != "zero3" else []:
            q = p.detach().clone()
            dist.broadcast(q, 0)
            torch.testing.assert_close(p.detach(), q)

    # bytes per step and per-rank state bytes against lmstack.accounting (fp32, M = world)
    cfg = cases[0][2]["cfg"]
    x, y = batches(1, 2 * world, 8)[0]
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    for strategy in ("bucketed", "naive", "zero1", "zero2", "zero3"):
        from lmstack.model.transformer import Transformer

        model = Transformer(cfg, seed=0)
        P = sum(p.numel() for p in model.parameters())
        runner, opt, wrapper = builders[strategy](model)
        ce(runner(xs), ys).backward()  # step 1 creates the optimizer states
        opt.step()
        opt.zero_grad()
        if strategy == "zero3":
            runner.prefetched = 0
        with C.count_bytes() as c:
            loss = ce(runner(xs), ys)
            if strategy == "zero3":  # every unit's full parameters were freed right after its use
                assert all(
                    u.buffer.untyped_storage().nbytes() == 0 for u in runner.units + [runner.root]
                )
            loss.backward()
            if strategy == "zero3":  # ... and again after the backward re-gather
                assert all(
                    u.buffer.untyped_storage().nbytes() == 0 for u in runner.units + [runner.root]
                )
                assert runner.prefetched >= 2 * (
                    len(runner.units) - 1
                )  # the next block, both directions
            acc_name = {"bucketed": "ddp", "naive": "ddp"}.get(strategy, strategy)
            if strategy in ("zero1", "zero2"):
                measured = opt.state_bytes()  # after backward, before the step
            elif strategy == "zero3":
                measured = runner.state_bytes(opt)
            else:
                measured = {
                    "master_weights": 4 * P,
                    "optimizer": sum(
                        v.numel() * v.element_size()
                        for st in opt.state.values()
                        for k, v in st.items()
                        if k != "step"
                    ),
                    "gradients": sum(p.grad.numel() * 4 for p in model.parameters()),
                }
            opt.step()
            opt.zero_grad()
        predicted = data_parallel_step_bytes(P, world, acc_name, "fp32")
        sent = torch.tensor([float(c.total)], dtype=torch.float64)
        dist.all_reduce(sent)
        assert abs(sent.item() / world - predicted) < 1e-6 * predicted, (
            strategy,
            sent.item() / world,
            predicted,
        )
        mem = training_memory_per_device(cfg, 2 * world, 8, acc_name, world, mixed_precision=False)
        for k in ("master_weights", "optimizer", "gradients"):
            assert measured[k] == getattr(mem, k), (strategy, k, measured[k], getattr(mem, k))


def test_ddp_and_zero_match_single_process():
    world = 2
    cases = []
    for name, strategy, kw, accum, freeze in [
        ("naive-tied", "naive", dict(tie_embeddings=True), 1, ()),
        ("bucketed-frozen", "bucketed", {}, 1, ("blocks.0.attn.q_proj.weight", "norm.weight")),
        ("bucketed-accum", "bucketed", dict(tie_embeddings=True), 2, ()),
        ("zero1", "zero1", {}, 1, ()),
        (
            "zero2-accum-frozen",
            "zero2",
            dict(tie_embeddings=True),
            2,
            ("blocks.1.ffn.up_proj.weight",),
        ),
        ("zero3-tied", "zero3", dict(tie_embeddings=True), 1, ()),
        (
            "zero3-accum-frozen",
            "zero3",
            {},
            2,
            ("blocks.0.ffn_norm.weight", "blocks.1.attn.k_proj.weight"),
        ),
    ]:
        cfg = tiny_config(**kw)
        data = {"cfg": cfg, "batches": batches(2 * accum, 4, 16)}
        wl, wp = reference(cfg, data["batches"], accum=accum, freeze=freeze)
        cases.append((name, strategy, data, accum, freeze, wl, wp))
    spawn(_data_parallel, world, cases)


def _grad_norm_cases(rank, world, cases):
    """On each plan: this rank's half of the batch, forward/backward, the global gradient norm
    (``ParallelModel.grad_norm``, ``clip_grad_norm_`` and, for ZeRO-1/2, the optimizer's own
    ``clip_grad_norm_``), then one clipped SGD step; all against single-process values."""
    from lmstack.model.transformer import Transformer
    from lmstack.parallel.plan import parallelize

    for name, plan, cfg, (x, y), want_norm, max_norm, want_params in cases:
        for via in ("plan", "optimizer") if plan.get("zero") in (1, 2) else ("plan",):
            pm = parallelize(Transformer(cfg, seed=0), plan)
            opt = pm.build_optimizer(torch.optim.SGD, lr=1.0)
            pm.forward_backward(x, y, ce)
            if via == "plan":
                norm = float(pm.grad_norm())
                assert abs(norm - want_norm) < 1e-5 * want_norm, (name, rank, norm, want_norm)
                clipped = float(pm.clip_grad_norm_(max_norm))
            else:
                clipped = float(opt.clip_grad_norm_(max_norm))
            assert abs(clipped - want_norm) < 1e-5 * want_norm, (
                name,
                via,
                rank,
                clipped,
                want_norm,
            )
            opt.step()
            assert_close_params(
                pm.full_state_dict(), want_params, atol=1e-6, rtol=1e-5, prefix=f"{name} {via} "
            )


def test_zero_gradient_norm_spans_data_parallel_ranks():
    """The norm of the whole gradient, not of this rank's shard: ZeRO-1/2 reduce-scatter the
    gradient and ZeRO-3 shards it, so each rank holds only part of it and the squares must be
    summed over dp. Reference: one process on the whole batch, ``torch.nn.utils.clip_grad_norm_``
    and ``torch.optim.SGD``. Clipping is active (max_norm = half the norm)."""
    world = 2
    cfg = tiny_config(tie_embeddings=True)
    x, y = batches(1, 4, 16)[0]
    model = Transformer(cfg, seed=0)
    ce(model(x), y).backward()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    max_norm = norm / 2
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    cases = [
        (name, plan, cfg, (x, y), norm, max_norm, want)
        for name, plan in [
            ("dp", dict(dp=2)),
            ("zero1", dict(dp=2, zero=1)),
            ("zero2", dict(dp=2, zero=2)),
            ("zero3", dict(dp=2, zero=3)),
        ]
    ]
    spawn(_grad_norm_cases, world, cases)
