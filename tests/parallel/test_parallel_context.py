"""Context parallelism (CS336 notes "序列并行和上下文并行"): causal, load-balanced ring attention with
log-sum-exp merging trains like one process on the whole sequence."""

import torch
import torch.distributed as dist
from parallel_helpers import (
    assert_close_params,
    batches,
    ce,
    make_opt,
    reference,
    spawn,
    tiny_config,
)


def _context(rank, world, cases):
    from lmstack.model.attention import attention_mask, reference_attention
    from lmstack.model.transformer import Transformer
    from lmstack.parallel.context import ContextParallel, load_balanced_positions, ring_attention
    from lmstack.parallel.ddp import DataParallel

    # ring attention alone == full causal attention at this rank's positions
    g = torch.Generator().manual_seed(0)
    B, N, S, H = 2, 2, 16, 8
    q, k, v = (torch.randn(B, N, S, H, generator=g) for _ in range(3))
    full = reference_attention(q, k, v, attention_mask(torch.arange(S), torch.arange(S)))
    pos = load_balanced_positions(S, world, rank)
    got = ring_attention(q[:, :, pos], k[:, :, pos], v[:, :, pos], pos, pos, None)
    torch.testing.assert_close(got, full[:, :, pos], atol=1e-5, rtol=1e-5)

    for name, cfg, data, wl, wp in cases:
        model = Transformer(cfg, seed=0)
        cpm = ContextParallel(model, None)
        runner = DataParallel(cpm)  # parameters are replicated over cp: average their gradients
        opt = make_opt(model.parameters())
        losses = []
        for x, y in data:
            loss = ce(runner(x), cpm.shard(y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(float(t) / world)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(wl), atol=1e-5, rtol=1e-5)
        assert_close_params(
            {n.replace(".inner.", "."): p.detach() for n, p in model.named_parameters()},
            wp,
            prefix=name + " ",
        )


def _cases():
    cases = []
    for tie in (False, True):
        cfg = tiny_config(tie_embeddings=tie, qk_norm=tie)
        data = batches(2, 2, 16)
        wl, wp = reference(cfg, data)
        cases.append((f"cp-tied{tie}", cfg, data, wl, wp))
    return cases


def test_ring_attention_matches_single_process():
    spawn(_context, 2, _cases())


def test_ring_attention_four_ranks():
    spawn(_context, 4, _cases()[:1])
