"""AdamW / SGD vs torch.optim step for step; clipping vs clip_grad_norm_; schedules at hand-checked points."""

import copy
import math

import pytest
import torch

from lmstack.train import SGD, AdamW, LRSchedule, clip_grad_norm, cosine_lr, wsd_lr


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    data = [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(100)]
    return model, data


def _groups(model, wd):
    ps = list(model.parameters())
    return [
        {"params": [p for p in ps if p.dim() == 2], "weight_decay": wd},
        {"params": [p for p in ps if p.dim() == 1], "weight_decay": 0.0},
    ]


def _run(model, opt, data, lrs=None):
    losses = []
    for i, (x, y) in enumerate(data):
        if lrs is not None:
            for grp in opt.param_groups:
                grp["lr"] = lrs[i]
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_adamw_matches_torch_over_100_steps_with_weight_decay():
    model, data = _problem()
    ref = copy.deepcopy(model)
    lrs = [cosine_lr(t, 3e-2, 3e-3, 10, 100) for t in range(100)]
    ours = _run(model, AdamW(_groups(model, 0.1), lr=3e-2, betas=(0.9, 0.95), eps=1e-8), data, lrs)
    theirs = _run(
        ref, torch.optim.AdamW(_groups(ref, 0.1), lr=3e-2, betas=(0.9, 0.95), eps=1e-8), data, lrs
    )
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ours == pytest.approx(theirs, rel=1e-5)


def test_adamw_state_dict_round_trip_continues_identically():
    model, data = _problem(1)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    _run(model, opt, data[:10])
    clone = copy.deepcopy(model)
    opt2 = AdamW(clone.parameters(), lr=1e-2, weight_decay=0.05)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert _run(model, opt, data[10:20]) == _run(clone, opt2, data[10:20])


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.01)])
def test_sgd_matches_torch(momentum, wd):
    model, data = _problem(2)
    ref = copy.deepcopy(model)
    _run(model, SGD(model.parameters(), lr=1e-2, momentum=momentum, weight_decay=wd), data[:50])
    _run(
        ref,
        torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=momentum, weight_decay=wd),
        data[:50],
    )
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
def test_clip_grad_norm_matches_torch_and_ignores_frozen(max_norm):
    model, data = _problem(3)
    model[0].bias.requires_grad_(False)  # frozen: no grad, must be ignored
    ref = copy.deepcopy(model)
    for m in (model, ref):
        x, y = data[0]
        ((m(x) - y) ** 2).sum().backward()
    assert model[0].bias.grad is None
    ours = clip_grad_norm(model.parameters(), max_norm)
    theirs = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters()], max_norm)
    torch.testing.assert_close(ours, theirs)
    for a, b in zip(model.parameters(), ref.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)
    if max_norm < 1:
        total = math.sqrt(
            sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None)
        )
        assert total == pytest.approx(max_norm, rel=1e-4)


def test_clip_grad_norm_non_finite_is_reported_not_applied():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("inf"), 2.0])
    assert not torch.isfinite(clip_grad_norm([p], 1.0))
    assert p.grad[0] == 1.0


def test_optimizer_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="lr=-1"):
        AdamW(p, lr=-1)
    with pytest.raises(ValueError, match="beta2=1.0"):
        AdamW(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="momentum=1.5"):
        SGD(p, momentum=1.5)
    with pytest.raises(ValueError, match="max_norm=0"):
        clip_grad_norm(p, 0)


def test_cosine_schedule_hand_checked_points():
    # lr_max 1.0, lr_min 0.1, T_w = 10, T = 110
    assert cosine_lr(0, 1.0, 0.1, 10, 110) == pytest.approx(0.1)  # (0+1)/10
    assert cosine_lr(4, 1.0, 0.1, 10, 110) == pytest.approx(0.5)
    assert cosine_lr(9, 1.0, 0.1, 10, 110) == pytest.approx(1.0)
    assert cosine_lr(10, 1.0, 0.1, 10, 110) == pytest.approx(1.0)  # cos(0)
    assert cosine_lr(60, 1.0, 0.1, 10, 110) == pytest.approx(
        0.55
    )  # halfway: 0.1 + 0.45·(1 + cos(π/2))
    assert cosine_lr(35, 1.0, 0.1, 10, 110) == pytest.approx(
        0.1 + 0.45 * (1 + math.sqrt(0.5))
    )  # π/4
    assert cosine_lr(110, 1.0, 0.1, 10, 110) == pytest.approx(0.1)
    assert cosine_lr(500, 1.0, 0.1, 10, 110) == pytest.approx(0.1)


def test_wsd_schedule_hand_checked_points():
    # warmup 10, stable to 80, linear decay over 20 steps to 0.0 at 100
    assert wsd_lr(4, 2.0, 0.0, 10, 100, 20) == pytest.approx(1.0)
    assert wsd_lr(10, 2.0, 0.0, 10, 100, 20) == pytest.approx(2.0)
    assert wsd_lr(79, 2.0, 0.0, 10, 100, 20) == pytest.approx(2.0)
    assert wsd_lr(80, 2.0, 0.0, 10, 100, 20) == pytest.approx(2.0)
    assert wsd_lr(90, 2.0, 0.0, 10, 100, 20) == pytest.approx(1.0)
    assert wsd_lr(95, 2.0, 0.0, 10, 100, 20) == pytest.approx(0.5)
    assert wsd_lr(100, 2.0, 0.0, 10, 100, 20) == pytest.approx(0.0)
    assert wsd_lr(95, 2.0, 0.0, 10, 100, 20, "sqrt") == pytest.approx(2.0 * (1 - math.sqrt(0.75)))


def test_schedule_object_applies_and_validates():
    s = LRSchedule("wsd", 1.0, 0.1, 2, 10, decay_steps=4)
    opt = SGD([{"params": [torch.nn.Parameter(torch.ones(1))], "lr_scale": 0.5}], lr=1.0)
    assert s.apply(opt, 8) == pytest.approx(0.55)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.275)
    assert LRSchedule(**s.state_dict()) == s
    with pytest.raises(ValueError, match="schedule='linear'"):
        LRSchedule("linear")
    with pytest.raises(ValueError, match="min_lr=2"):
        LRSchedule("cosine", 1.0, 2.0)
    with pytest.raises(ValueError, match="decay_steps=0"):
        LRSchedule("wsd", 1.0, 0.0, 2, 10, decay_steps=0)
