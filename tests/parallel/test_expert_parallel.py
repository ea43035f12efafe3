"""Expert parallelism (CS336 notes "专家并行") on gloo ranks: routed experts sharded over the ranks, tokens
dispatched and combined by all-to-all; data-parallel training over the same ranks equals single-process
training on the concatenated batch (losses 1e-5, weights 1e-4)."""

import copy

import pytest
import torch
import torch.distributed as dist
from parallel_helpers import batches, ce, spawn, tiny_config


def _ep_train(rank, world, steps, router="topk"):
    from lmstack.model.moe import moe_modules
    from lmstack.model.transformer import Transformer
    from lmstack.parallel.expert import (
        ExpertParallelMoE,
        expert_parallel,
        sync_expert_parallel_grads,
    )

    cfg = tiny_config(
        n_experts=2 * world,
        n_experts_per_token=2,
        d_ff_expert=16,
        n_shared_experts=1,
        moe_first_dense=1,
        n_layers=3,
        router=router,
    )
    ref = Transformer(cfg, seed=0)  # the same seeded weights on every rank
    model = expert_parallel(copy.deepcopy(ref))
    eps = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    assert len(eps) == 2 and eps[0].gate_proj.weight.shape[0] == 2  # E/ep experts per rank
    assert len(moe_modules(model)) == 2
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    b = 2  # sequences per rank
    recv_counts = []
    for x, y in batches(steps, b * world, 8, seed=3):
        loss_ref = ce(ref(x), y)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        xs, ys = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
        loss = ce(model(xs), ys)
        loss.backward()
        sync_expert_parallel_grads(model)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        assert abs(mean.item() / world - loss_ref.item()) < 1e-5
        recv_counts.append(int(eps[0].stats["load"][eps[0].lo : eps[0].lo + 2].sum()))
    ref_params = dict(ref.named_parameters())
    assert set(dict(model.named_parameters())) == set(ref_params)  # the same names, sliced experts
    for name, p in model.named_parameters():
        q = ref_params[name]
        if (
            name.endswith(("ffn.gate_proj.weight", "ffn.up_proj.weight", "ffn.down_proj.weight"))
            and p.dim() == 3
        ):
            lo = rank * 2
            torch.testing.assert_close(p.detach(), q.detach()[lo : lo + 2], atol=1e-4, rtol=1e-4)
        else:
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-4, rtol=1e-4)
    # uneven splits: the ranks' experts received different numbers of rows
    counts = torch.tensor(recv_counts)
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    assert len({tuple(g.tolist()) for g in gathered}) > 1


def _ep_bytes(rank, world):
    """All-to-all bytes of one MoE layer's forward + backward, counted, == accounting (uniform routing)."""
    from lmstack.accounting.comm import moe_all_to_all_bytes
    from lmstack.model.config import ModelConfig
    from lmstack.parallel import collectives as C
    from lmstack.parallel.expert import combine, dispatch

    T, k, D, E = 6 * world, 2, 8, 2 * world
    ids = (
        torch.arange(T * k) + rank
    ) % E  # every expert gets the same number of rows from every rank
    x = torch.randn(T * k, D, requires_grad=True)
    with C.count_bytes() as c:
        recv, meta = dispatch(x, ids, E)
        combine(recv * 2, meta).sum().backward()
    cfg = ModelConfig(
        vocab_size=8, d_model=D, n_layers=1, n_heads=2, d_ff=8, n_experts=E, n_experts_per_token=k
    )
    assert c.sent["all_to_all"] == moe_all_to_all_bytes(cfg, T, world, "fp32")
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_all_to_all_bytes_equal_accounting():
    spawn(_ep_bytes, 4)


def _skewed_ids(q, n, E):
    """Rank q's expert ids: half its rows to expert 0 (rank 0's), the rest spread over experts 2..5 (ranks 1, 2)
    by a q-dependent stride; no row goes to the last rank's experts 6, 7."""
    return torch.tensor([0] * (n // 2) + [2 + (j * (q + 1)) % 4 for j in range(n - n // 2)])


def _ep_bytes_skewed(rank, world):
    """Skewed routing (send != recv, one rank receives nothing): the rows each rank receives are exactly the
    other ranks' rows routed to its experts, the round trip is the identity, and the counted all-to-all bytes
    equal a hand count: 2 · (rows sent to others + rows received from others) · D · 4 (fp32; dispatch and
    combine, forward and backward)."""
    from lmstack.parallel import collectives as C
    from lmstack.parallel.expert import combine, dispatch

    n, D, E, per = 10, 8, 2 * world, 2
    xs = [torch.randn(n, D, generator=torch.Generator().manual_seed(100 + q)) for q in range(world)]
    ids = [_skewed_ids(q, n, E) for q in range(world)]
    x = xs[rank].clone().requires_grad_(True)
    with C.count_bytes() as c:
        recv, meta = dispatch(x, ids[rank], E)
        combine(recv * 2, meta).sum().backward()
    mine = [
        (xs[q][ids[q] // per == rank], ids[q][ids[q] // per == rank]) for q in range(world)
    ]  # by source rank
    torch.testing.assert_close(recv, torch.cat([r for r, _ in mine]), rtol=0, atol=0)
    assert meta.local_expert_ids.tolist() == torch.cat([i for _, i in mine]).tolist()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    sent = int((ids[rank] // per != rank).sum())
    received = sum(int((ids[q] // per == rank).sum()) for q in range(world) if q != rank)
    assert c.sent["all_to_all"] == 2 * (sent + received) * D * 4
    want = {
        0: (5, 15),
        3: (10, 0),
    }  # worked by hand for 4 ranks: rank 0 sends 5 of 10, gets 3 x 5; rank 3 gets none
    if world == 4 and rank in want:
        assert (sent, received) == want[rank]


def test_all_to_all_bytes_with_skewed_routing():
    spawn(_ep_bytes_skewed, 4)


def _ep_bad(rank, world):
    from lmstack.model.moe import MoE
    from lmstack.parallel.expert import ExpertParallelMoE

    with pytest.raises(ValueError, match=f"n_experts=6 is not divisible by ep={world}"):
        ExpertParallelMoE(MoE(8, 6, 2, 16))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_training_equals_single_process(world):
    spawn(_ep_train, world, 3)


@pytest.mark.slow
def test_expert_parallel_hash_routing_equals_single_process():
    # hash routing reads the input token ids (AttentionMetadata.token_ids) through the sharded layer too
    spawn(_ep_train, 2, 2, "hash")


def test_experts_not_divisible_by_ep():
    spawn(_ep_bad, 4)


def _ep_empty_rank(rank, world):
    """Every token routes to rank 0's experts, so rank 1's receive zero rows; forward and backward must still run
    the same collectives on both ranks (issue #31: a grad-less empty expert output skipped the combine's backward
    all-to-all on that rank and gloo aborted), and the gradients equal the unsharded layer's."""
    from lmstack.model.moe import MoE
    from lmstack.parallel.expert import ExpertParallelMoE

    torch.manual_seed(0)
    D, E = 8, 2 * world
    ref = MoE(D, E, 2, 16)
    with torch.no_grad():
        ref.router.weight.zero_()
        ref.router.weight[:2] = 5.0  # x > 0: experts 0 and 1 (rank 0's) win for every token
    layer = ExpertParallelMoE(copy.deepcopy(ref))
    x = torch.rand(2 * world, 3, D) + 0.1  # (B, T, D), positive
    x_ref = x.clone().requires_grad_(True)
    ref(x_ref).square().sum().backward()
    xs = x[rank * 2 : (rank + 1) * 2].clone().requires_grad_(True)
    out = layer(xs)
    out.square().sum().backward()
    torch.testing.assert_close(xs.grad, x_ref.grad[rank * 2 : (rank + 1) * 2], atol=1e-5, rtol=1e-4)
    own = (
        layer.gate_proj.weight.grad
    )  # this rank's experts: the rows of every rank were dispatched to them
    lo = rank * 2
    torch.testing.assert_close(own, ref.gate_proj.weight.grad[lo : lo + 2], atol=1e-5, rtol=1e-4)
    if rank == 1:
        assert own.abs().sum() == 0  # nothing was routed here


def test_expert_parallel_rank_with_no_rows_trains():
    spawn(_ep_empty_rank, 2)
