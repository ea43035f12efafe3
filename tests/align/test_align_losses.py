"""lmstack.align.losses at hand-worked numbers and against torch's own ops (the TRL parity tests are in
test_align_losses_trl.py)."""

import math

import pytest
import torch
import torch.nn.functional as F

from lmstack.align.losses import (
    aggregate,
    bradley_terry_loss,
    dpo_loss,
    group_advantages,
    kl_estimate,
    policy_gradient_loss,
    rloo_advantages,
    sft_loss,
    token_entropy,
    token_logprobs,
    zero_std_fraction,
)


def test_token_logprobs_and_entropy_equal_torch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    targets[0, :2] = -100
    ours = token_logprobs(logits, targets)
    ref = -F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)
    torch.testing.assert_close(ours, ref)
    assert (ours[0, :2] == 0).all()
    torch.testing.assert_close(
        token_entropy(logits), torch.distributions.Categorical(logits=logits).entropy()
    )


def test_sft_loss_per_token_and_per_sequence_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(sft_loss(logp, mask, "token")) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert float(sft_loss(logp, mask, "sequence")) == pytest.approx(((1 + 2 + 3) / 3 + 4) / 2)
    with pytest.raises(ValueError, match="normalize='batch'"):
        sft_loss(logp, mask, "batch")


def test_group_advantages_of_a_hand_made_group():
    r = torch.tensor(
        [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    )  # two prompts, G = 4; the second has no spread
    std = math.sqrt(4 * 0.25 / 3)  # unbiased (n − 1) std of {1, 0, 0, 1}
    a = 0.5 / (std + 1e-4)
    torch.testing.assert_close(group_advantages(r, 4), torch.tensor([a, -a, -a, a, 0, 0, 0, 0]))
    torch.testing.assert_close(
        group_advantages(r, 4, scale="none"),  # Dr. GRPO: centred only
        torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]),
    )
    assert zero_std_fraction(r, 4) == 0.5


def test_batch_std_advantages_by_hand():
    r = torch.tensor(
        [1.0, 0.0, 3.0, 3.0]
    )  # groups {1, 0}, {3, 3}; batch mean 1.75, unbiased batch std 1.5
    torch.testing.assert_close(
        group_advantages(r, 2, scale="batch"), torch.tensor([0.5 / 1.5001, -0.5 / 1.5001, 0.0, 0.0])
    )


def test_rloo_advantage_is_reward_minus_the_others_mean():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(rloo_advantages(r, 4), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_a_group_of_one_with_std_normalisation_is_refused():
    with pytest.raises(ValueError, match="group_size=1 with scale='group'"):
        group_advantages(torch.tensor([1.0, 0.0]), 1)
    with pytest.raises(ValueError, match="RLOO"):
        rloo_advantages(torch.tensor([1.0, 0.0]), 1)
    with pytest.raises(ValueError, match="do not split into groups of G=4"):
        group_advantages(torch.tensor([1.0, 0.0, 1.0]), 4)


def test_kl_estimators_at_known_delta():
    logp = torch.tensor([0.0, 0.0])
    ref = torch.tensor([math.log(2), -math.log(2)])  # δ = log π_ref − log π_θ = ±log 2
    torch.testing.assert_close(
        kl_estimate(logp, ref, "k3"), torch.tensor([2 - math.log(2) - 1, 0.5 + math.log(2) - 1])
    )
    torch.testing.assert_close(
        kl_estimate(logp, ref, "k1"), torch.tensor([-math.log(2), math.log(2)])
    )
    torch.testing.assert_close(
        kl_estimate(logp, ref, "k2"), torch.tensor([math.log(2) ** 2 / 2] * 2)
    )


def test_k1_and_k3_are_unbiased_estimates_of_the_kl():
    """Averaged over tokens sampled from π_θ, k1 and k3 both estimate KL(π_θ ‖ π_ref) (torch's closed form)."""
    g = torch.Generator().manual_seed(0)
    p = torch.distributions.Categorical(logits=torch.randn(20, generator=g))
    q = torch.distributions.Categorical(logits=torch.randn(20, generator=g))
    x = torch.multinomial(p.probs, 400_000, replacement=True, generator=g)
    true = float(torch.distributions.kl_divergence(p, q))
    for kind in ("k1", "k3"):
        est = float(kl_estimate(p.log_prob(x), q.log_prob(x), kind).mean())
        assert est == pytest.approx(true, rel=0.02), kind
    assert float(kl_estimate(p.log_prob(x), q.log_prob(x), "k3").min()) >= 0.0


def test_clip_loss_and_clip_fractions_by_hand():
    ratio = torch.tensor([[0.5, 0.9, 1.0, 1.5]])
    old = torch.zeros(1, 4)
    A = torch.tensor([[-1.0, -1.0, 1.0, 1.0]])
    loss, info = policy_gradient_loss(ratio.log(), A, old, kind="clip", eps_low=0.2, eps_high=0.2)
    # −min(ρA, clip(ρ, 0.8, 1.2)A): tokens 0.8 (ρ=0.5 clipped up), 0.9, −1.0, −1.2 (ρ=1.5 clipped down)
    torch.testing.assert_close(loss, torch.tensor([[0.8, 0.9, -1.0, -1.2]]))
    assert info["low"].tolist() == [[True, False, False, False]]
    assert info["high"].tolist() == [[False, False, False, True]]
    # clip-higher (DAPO): ε_high = 0.6 lets ρ = 1.5 through
    loss, info = policy_gradient_loss(ratio.log(), A, old, kind="clip", eps_low=0.2, eps_high=0.6)
    torch.testing.assert_close(loss[0, 3], torch.tensor(-1.5))
    assert not info["high"].any()


def test_dual_clip_caps_negative_advantages():
    ratio = torch.tensor([[5.0, 2.0, 5.0]])
    A = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, info = policy_gradient_loss(
        ratio.log(), A, torch.zeros(1, 3), kind="dual_clip", dual_clip_c=3.0
    )
    # A<0, ρ=5: the PPO loss is 5, capped at c·|A| = 3; ρ=2 stays 2; A>0 is untouched (−1.2)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0, -1.2]]))
    assert info["dual"].tolist() == [[True, False, False]]


def test_naive_policy_gradient_and_baseline_gradients():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = policy_gradient_loss(
        logp, torch.tensor([2.0]), kind="naive", baseline=torch.tensor([0.5])
    )
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, -1.5]]))  # ∂/∂logπ of −(A − b)logπ
    logp.grad = None
    loss, _ = policy_gradient_loss(logp, torch.tensor([2.0]), logp.detach(), kind="no_clip")
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -2.0]]))  # at ρ = 1: −A·∇log π


def test_aggregation_modes_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(aggregate(per_token, mask, "seq_mean_token_mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(per_token, mask, "token_mean")) == pytest.approx(10 / 4)
    assert float(aggregate(per_token, mask, "seq_mean_token_sum_norm", max_len=5)) == pytest.approx(
        10 / (2 * 5)
    )
    with pytest.raises(ValueError, match="max_len"):
        aggregate(per_token, mask, "seq_mean_token_sum_norm")


def test_dpo_losses_by_hand():
    zero = torch.zeros(1)
    # equal policy and reference: h = 0, the sigmoid loss is log 2, hinge 1, IPO (1/(2β))²
    assert float(dpo_loss(zero, zero, zero, zero, beta=0.1)) == pytest.approx(math.log(2))
    assert float(dpo_loss(zero, zero, zero, zero, beta=0.1, loss_type="hinge")) == pytest.approx(
        1.0
    )
    one = torch.ones(1)
    assert float(
        dpo_loss(
            zero,
            zero,
            zero,
            zero,
            beta=0.1,
            loss_type="ipo",
            chosen_lengths=one,
            rejected_lengths=one,
        )
    ) == pytest.approx(25.0)
    c, r = torch.tensor([-1.0]), torch.tensor([-3.0])  # h = 2
    assert float(dpo_loss(c, r, zero, zero, beta=0.5)) == pytest.approx(math.log1p(math.exp(-1.0)))
    assert float(dpo_loss(c, r, zero, zero, beta=0.5, loss_type="robust")) == pytest.approx(
        math.log1p(math.exp(-1))
    )
    eps = 0.1
    robust = (
        -(1 - eps) * F.logsigmoid(torch.tensor(1.0)) + eps * F.logsigmoid(torch.tensor(-1.0))
    ) / (1 - 2 * eps)
    assert float(
        dpo_loss(c, r, zero, zero, beta=0.5, loss_type="robust", label_smoothing=eps)
    ) == pytest.approx(float(robust))
    with pytest.raises(ValueError, match="loss_type='kto'"):
        dpo_loss(c, r, zero, zero, loss_type="kto")


def test_bradley_terry_is_binary_cross_entropy_on_the_score_difference():
    rc, rr = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.5])
    ref = F.binary_cross_entropy_with_logits(rc - rr, torch.ones(3))
    torch.testing.assert_close(bradley_terry_loss(rc, rr), ref)
