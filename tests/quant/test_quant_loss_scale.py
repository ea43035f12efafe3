"""Dynamic loss scaling against torch.amp.GradScaler's schedule, and fp16 underflow against hand-worked values."""

import pytest
import torch

from lmstack.quant.loss_scale import DynamicLossScaler, underflow_fraction


def test_underflow_hand_worked():
    g = torch.tensor([1e-3, 2.0**-20, 2.0**-25, 2.0**-26, 1e-9, 0.0])
    # fp16: 2^-20 is a subnormal (kept), 2^-25 is half the smallest subnormal (ties to even: 0),
    # 2^-26 and 1e-9 flush to 0 -> 3 of the 5 non-zero values; bf16 keeps all
    assert underflow_fraction(g, torch.float16) == pytest.approx(3 / 5)
    assert underflow_fraction(g, torch.bfloat16) == 0.0
    assert (
        underflow_fraction(g * 2.0**16, torch.float16) == 0.0
    )  # scaled by 2^16: all representable


def test_schedule_equals_torch_gradscaler():
    """Same sequence of finite / non-finite gradients -> the same scales and skipped steps as GradScaler."""
    pattern = [False, False, True, False, False, False, True, True, False, False, False, False]
    w_ours = torch.nn.Parameter(torch.ones(3))
    w_ref = torch.nn.Parameter(torch.ones(3))
    opt_ours = torch.optim.SGD([w_ours], lr=0.1)
    opt_ref = torch.optim.SGD([w_ref], lr=0.1)
    ours = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    ref = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    for bad in pattern:
        for w, scaler, opt in ((w_ours, ours, opt_ours), (w_ref, ref, opt_ref)):
            opt.zero_grad()
            loss = (w * torch.tensor([1.0, 2.0, float("inf") if bad else 3.0])).sum()
            scaled = scaler.scale(loss)
            scaled.backward()
        ours.step(opt_ours, [w_ours])
        ref.step(opt_ref)
        ref.update()
        assert ours.scale_value == ref.get_scale()
        torch.testing.assert_close(w_ours.detach(), w_ref.detach())
    assert ours.skipped == 3


def test_bad_arguments():
    with pytest.raises(ValueError, match="backoff"):
        DynamicLossScaler(backoff=1.5)
