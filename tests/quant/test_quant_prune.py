"""Width pruning: parameter counts equal accounting's formula, the kept slices are the important ones (checked
on a model made to have known important channels), pruning nothing keeps the function; the distillation loss
against KL written plainly in float64, and distillation lowers it."""

import math

import pytest
import torch

from lmstack.accounting.params import total_params
from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.quant.prune import distill, distill_loss, importance, prune_width

pytestmark = pytest.mark.usefixtures("one_thread")


def teacher():
    cfg = ModelConfig(
        vocab_size=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=128,
        max_seq_len=64,
        tie_embeddings=True,
    )
    return Transformer(cfg, seed=3).eval()


def tokens(seed=0, b=8):
    return torch.randint(0, 128, (b, 24), generator=torch.Generator().manual_seed(seed))


def test_pruned_parameter_counts_equal_accounting():
    small = prune_width(teacher(), tokens(), d_ff=96, n_kv_heads=1, d_model=48)
    c = small.config
    assert (c.d_ff, c.n_kv_heads, c.n_heads, c.d_model, c.head_dim) == (96, 1, 2, 48, 16)
    assert sum(p.numel() for p in small.parameters()) == total_params(c)
    assert small(tokens()[:1]).shape == (1, 24, 128)


def test_pruning_nothing_keeps_the_function():
    t = teacher()
    same = prune_width(t, tokens())
    with torch.no_grad():
        torch.testing.assert_close(same(tokens(1)), t(tokens(1)))


def test_keeps_the_important_ffn_channels():
    t = teacher()
    with torch.no_grad():
        t.blocks[0].ffn.up_proj.weight[[5, 77]] *= 50  # two loud FFN channels in layer 0
    imp = importance(t, tokens())
    assert set(torch.topk(imp["ffn"][0], 2).indices.tolist()) == {5, 77}
    small = prune_width(t, tokens(), d_ff=16)
    kept = small.blocks[0].ffn.up_proj.weight
    for ch in (5, 77):  # the loud rows survive, in order
        assert any(torch.equal(row, t.blocks[0].ffn.up_proj.weight[ch]) for row in kept)


def test_distill_loss_equals_plain_kl():
    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(3, 5, 11, generator=g), torch.randn(3, 5, 11, generator=g)
    T = 2.0
    total = 0.0
    for a, b in zip(zt.reshape(-1, 11).double().tolist(), zs.reshape(-1, 11).double().tolist()):
        pt = [math.exp(x / T) for x in a]
        ps = [math.exp(x / T) for x in b]
        pt = [x / sum(pt) for x in pt]
        ps = [x / sum(ps) for x in ps]
        total += sum(p * math.log(p / q) for p, q in zip(pt, ps))
    assert float(distill_loss(zs, zt, T)) == pytest.approx(T * T * total / 15, rel=1e-5)
    assert float(distill_loss(zt, zt)) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        distill_loss(zs, zt, 0.0)


def test_distillation_recovers():
    cfg = ModelConfig(
        vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
    )
    t = Transformer(cfg, seed=3).eval()
    with torch.no_grad():  # peaky teacher distributions (a random init's are nearly flat)
        t.lm_head.weight.mul_(10)
    small = prune_width(t, tokens(), d_ff=64, n_kv_heads=1)
    held = tokens(5, 4)
    with torch.no_grad():
        before = float(distill_loss(small(held), t(held)))
    torch.manual_seed(0)
    distill(small, t, tokens(2, 32), steps=30, lr=1e-3)
    with torch.no_grad():
        after = float(distill_loss(small(held), t(held)))
    assert before > 0.05 and after < 0.7 * before, (before, after)


def test_distill_calls_on_step_with_the_student_as_it_stands():
    """on_step(k, loss_k) runs after step k in eval mode: the KL it measures (plain float64) on step k+1's batch
    equals the loss distill then reports for step k+1, which is computed with the same parameters."""
    t = teacher()
    small = prune_width(t, tokens(), d_ff=64, n_kv_heads=1)
    data = tokens(2, 12)  # 3 batches of 4 rows, in turn
    seen = []

    def on_step(step, loss):
        assert not small.training
        x = data[(torch.arange(step * 4, step * 4 + 4)) % 12]
        with torch.no_grad():
            ls = torch.log_softmax(small(x).double(), -1)
            lt = torch.log_softmax(t(x).double(), -1)
        seen.append((step, loss, float((lt.exp() * (lt - ls)).sum(-1).mean())))

    losses = distill(small, t, data, steps=3, lr=1e-3, on_step=on_step)
    assert [s for s, _, _ in seen] == [1, 2, 3] and [l for _, l, _ in seen] == losses
    for k in range(2):
        assert seen[k][2] == pytest.approx(losses[k + 1], rel=1e-4)
    assert not small.training


def test_bad_widths():
    with pytest.raises(ValueError, match="d_ff=256"):
        prune_width(teacher(), tokens(), d_ff=256)


def test_rescaled_norm_gives_kept_channels_their_magnitudes():
    """With one calibration token the first attention norm's input is one embedding row x: the pruned norm's
    output on the kept channels equals the teacher's norm output there (γ scaled by sqrt((mean_kept x² + ε) /
    (mean_all x² + ε)), recomputed here in float64); without the rescale it is smaller by that factor."""
    t = teacher()
    tok = tokens(b=1)[:, :1]
    small = prune_width(t, tok, d_model=40)
    plain = prune_width(t, tok, d_model=40, rescale_norms=False)
    x = t.embed.weight[tok[0, 0]].double()  # (D,)
    kept = torch.tensor(
        [
            i
            for i in range(64)
            if any(torch.equal(t.embed.weight[:, i], c) for c in small.embed.weight.t())
        ]
    )
    assert kept.numel() == 40
    ref = (
        x
        / torch.sqrt((x**2).mean() + t.blocks[0].attn_norm.eps)
        * t.blocks[0].attn_norm.weight.double()
    )[kept]
    with torch.no_grad():
        got = small.blocks[0].attn_norm(x[kept].float()[None]).double()[0]
        shrunk = plain.blocks[0].attn_norm(x[kept].float()[None]).double()[0]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    eps = t.blocks[0].attn_norm.eps
    factor = torch.sqrt(((x[kept] ** 2).mean() + eps) / ((x**2).mean() + eps))
    torch.testing.assert_close(shrunk * factor, ref, rtol=1e-5, atol=1e-6)
