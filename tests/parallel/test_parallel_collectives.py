"""Collectives (Book of LLMs §6.2 “collectives”): the ring against torch.distributed's collectives, bytes sent
against the accounting model, autograd duals against hand-derived gradients; the mesh layout."""

import pytest
import torch
import torch.distributed as dist
from parallel_helpers import spawn


def _collectives(rank, world):
    from lmstack.accounting.comm import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
    from lmstack.parallel import collectives as C
    from lmstack.parallel.mesh import DeviceMesh

    g = torch.Generator().manual_seed(rank)
    # ring all-reduce == dist.all_reduce, even and uneven sizes
    for n in (1, 7, 1000, 4096):
        x = torch.randn(n, generator=g, dtype=torch.float64)
        want = x.clone()
        dist.all_reduce(want)
        with C.count_bytes() as c:
            got = C.ring_all_reduce_(x.clone())
        torch.testing.assert_close(got, want)
        # bytes: per rank exact when n divides by M; the mean over ranks always
        sent = torch.tensor([float(c.total)], dtype=torch.float64)
        dist.all_reduce(sent)
        assert sent.item() / world == pytest.approx(all_reduce_bytes(n * 8, world))
        if n % world == 0:
            assert c.total == all_reduce_bytes(n * 8, world)
    # ring reduce-scatter / all-gather == torch's
    x = torch.randn(world * 6, generator=g)
    want = torch.empty(6)
    C.reduce_scatter_into(want, x.clone(), None)
    with C.count_bytes() as c:
        got = C.reduce_scatter(x, None)
    torch.testing.assert_close(got, want)
    assert c.total == reduce_scatter_bytes(x.numel() * 4, world)
    with C.count_bytes() as c:
        got = C.all_gather(want, None)
    ref = torch.empty(world * 6)
    C.all_gather_into(ref, want, None)
    torch.testing.assert_close(got, ref)
    assert c.total == all_gather_bytes(ref.numel() * 4, world)

    # autograd duals: y = AllGather(x); L = sum_r <w_r, y> summed over ranks
    # => dL/dx_r = sum over ranks of w's slice r: a reduce-scatter of the w's
    x = torch.randn(2, 3, generator=g, requires_grad=True)
    w = torch.randn(2 * world, 3, generator=torch.Generator().manual_seed(100 + rank))
    y = C.AllGatherFn.apply(x, 0, None)
    (y * w).sum().backward()
    w_all = [
        torch.randn(2 * world, 3, generator=torch.Generator().manual_seed(100 + r))
        for r in range(world)
    ]
    torch.testing.assert_close(x.grad, sum(w_all)[2 * rank : 2 * rank + 2])
    # reduce-scatter forward, all-gather backward
    x = torch.randn(2 * world, 3, generator=g, requires_grad=True)
    w = torch.randn(2, 3, generator=torch.Generator().manual_seed(200 + rank))
    y = C.ReduceScatterFn.apply(x, 0, None)
    (y * w).sum().backward()
    w_all = [
        torch.randn(2, 3, generator=torch.Generator().manual_seed(200 + r)) for r in range(world)
    ]
    torch.testing.assert_close(x.grad, torch.cat(w_all))
    # all-reduce forward, all-reduce backward
    x = torch.randn(4, generator=g, requires_grad=True)
    w = torch.randn(4, generator=torch.Generator().manual_seed(300 + rank))
    (C.AllReduceFn.apply(x, None) * w).sum().backward()
    w_all = [torch.randn(4, generator=torch.Generator().manual_seed(300 + r)) for r in range(world)]
    torch.testing.assert_close(x.grad, sum(w_all))

    # mesh: tp fastest, groups partition the world
    mesh = DeviceMesh.build(tp=2)
    assert mesh.dp == world // 2
    assert mesh.ranks("tp") == [rank - rank % 2, rank - rank % 2 + 1]
    assert mesh.ranks("dp") == list(range(rank % 2, world, 2))
    t = torch.tensor([float(rank)])
    C.all_reduce(t, mesh.group("tp"))
    assert t.item() == sum(mesh.ranks("tp"))
    with pytest.raises(ValueError, match="not divisible"):
        DeviceMesh.build(tp=3)

    # expert-parallel seam: all-to-all dispatch to the owning rank, combine back in token order;
    # "expert e" multiplies by e + 1, so the result and its gradient are known in closed form
    from lmstack.parallel.expert import combine, dispatch

    E = 2 * world
    x = torch.randn(6, 3, generator=g, requires_grad=True)
    ids = torch.randint(0, E, (6,), generator=g)
    recv, meta = dispatch(x, ids, E, None)
    assert ((meta.local_expert_ids // (E // world)) == rank).all()
    out = combine(recv * (meta.local_expert_ids + 1)[:, None].float(), meta, None)
    torch.testing.assert_close(out, x * (ids + 1)[:, None].float())
    w = torch.randn(6, 3, generator=g)
    (out * w).sum().backward()
    torch.testing.assert_close(x.grad, w * (ids + 1)[:, None].float())


def test_collectives_ring_duals_mesh():
    spawn(_collectives, 4)


def test_bubble_simulation_matches_formula():
    from lmstack.parallel.pipeline import bubble_formula, schedule, simulate

    for p, m in [(2, 4), (4, 8), (4, 4), (3, 7)]:
        for kind in ("gpipe", "1f1b"):
            assert simulate(schedule(kind, p, m))["bubble"] == pytest.approx(bubble_formula(p, m))
        zb = simulate(schedule("zb", p, m))["bubble"]
        assert zb < bubble_formula(p, m)
        # every stage runs every F, B and W exactly once
        for orders in schedule("zb", p, m):
            assert sorted(orders) == sorted([(k, i) for k in "FBW" for i in range(m)])


def test_1f1b_keeps_at_most_p_minus_s_in_flight():
    from lmstack.parallel.pipeline import schedule

    p, m = 4, 8
    for s, orders in enumerate(schedule("1f1b", p, m)):
        live = peak = 0
        for k, _ in orders:
            live += 1 if k == "F" else -1
            peak = max(peak, live)
        assert peak == p - s


def test_plan_parsing_and_errors():
    from lmstack.parallel.context import load_balanced_positions
    from lmstack.parallel.pipeline import stage_layers
    from lmstack.parallel.plan import ParallelPlan

    assert ParallelPlan.parse("dp=2,tp=2,zero=1") == ParallelPlan(dp=2, tp=2, zero=1)
    assert ParallelPlan.parse({"dp": 2, "tp": 2, "zero": 1}).zero == 1
    assert ParallelPlan.parse("fsdp").zero == 3
    with pytest.raises(ValueError, match="unknown key"):
        ParallelPlan.parse({"dq": 2})
    with pytest.raises(ValueError, match="zero=5"):
        ParallelPlan(zero=5)
    with pytest.raises(ValueError, match="needs tp > 1"):
        ParallelPlan(sequence_parallel=True)
    # load balance: the cp ranks' positions partition 0..S-1 with equal causal work
    S, cp = 16, 4
    parts = [load_balanced_positions(S, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(S))
    work = [int((p + 1).sum()) for p in parts]  # keys each rank's queries attend to
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="divisible by 2·cp"):
        load_balanced_positions(10, 4, 0)
    assert [stage_layers(10, 4, s) for s in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_cli_bubble_and_mesh(capsys):
    from lmstack.cli import main

    assert main(["parallel", "bubble", "--pp", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert "formula (p-1)/(m+p-1) = 0.273" in out and "1f1b  bubble 0.273" in out
    assert main(["parallel", "mesh", "--world", "8", "--tp", "2", "--pp", "2"]) == 0
    assert "rank   5: pp=1 dp=0 cp=0 tp=1" in capsys.readouterr().out
    assert main(["parallel", "mesh", "--world", "6", "--tp", "4"]) == 2
