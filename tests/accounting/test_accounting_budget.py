"""Resource budgets (CS336 notes "可用资源盘点") by hand."""

import pytest

from lmstack.accounting.budget import max_params_for_memory, trainable_tokens, training_time_s


def test_training_time_llama2_7b_hand():
    # 6 · 6.74e9 · 2e12 = 8.088e22 FLOPs on 1024 A100s (312e12) at MFU 0.5: 506,250 s ≈ 5.86 days
    t = training_time_s(6.74e9, 2e12, 312e12, 1024, mfu=0.5)
    assert t == pytest.approx(8.088e22 / (0.5 * 312e12 * 1024))
    assert t / 86400 == pytest.approx(5.86, abs=0.01)
    assert trainable_tokens(6.74e9, t, 312e12, 1024, mfu=0.5) == pytest.approx(2e12)
    with pytest.raises(ValueError, match="mfu=0"):
        training_time_s(1, 1, 1, mfu=0)


def test_max_params():
    # One 80 GB H100: 80e9 / 18 ≈ 4.44e9 parameters for AdamW training; 40e9 for bf16 inference.
    assert max_params_for_memory(80e9) == pytest.approx(4.444e9, rel=1e-3)
    assert max_params_for_memory(80e9, 2) == 40e9
