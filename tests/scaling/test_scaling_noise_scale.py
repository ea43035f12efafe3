"""B_simple on linear regression, where tr Σ and |G|² are known in closed form."""

import numpy as np
import pytest
import torch

from lmstack.scaling.noise_scale import NoiseScale, grad_sq_norm, noise_estimates


def test_estimates_invert_the_expectation():
    # E|G_B|² = |G|² + tr Σ / B exactly -> the two-point formulas return |G|² and tr Σ
    G2, S = 3.0, 120.0
    g2, s = noise_estimates(G2 + S / 8, 8, G2 + S / 64, 64)
    assert g2 == pytest.approx(G2) and s == pytest.approx(S)
    with pytest.raises(ValueError, match="b_small < b_big"):
        noise_estimates(1, 8, 1, 8)


def test_b_simple_on_linear_regression():
    # loss_i = (w·x_i - y_i)²/2, x ~ N(0, I_d), y = w*·x + ε, ε ~ N(0, σ²); at w = w* + e:
    # G = e, tr Σ = E|g|² - |G|² = (d + 2)|e|² + dσ² - |e|² = (d + 1)|e|² + dσ²   (Gaussian 4th moments)
    d, sigma = 16, 0.5
    gen = torch.Generator().manual_seed(0)
    w_star = torch.randn(d, generator=gen)
    e = torch.randn(d, generator=gen) * 0.3
    model = torch.nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + e)[None])
    expected = ((d + 1) * e.pow(2).sum() + d * sigma**2) / e.pow(2).sum()

    def g2(batch):
        x = torch.randn(batch, d, generator=gen)
        y = x @ w_star + sigma * torch.randn(batch, generator=gen)
        model.zero_grad()
        (0.5 * (model(x)[:, 0] - y).pow(2).mean()).backward()
        return grad_sq_norm(model)

    est = NoiseScale(beta=0.999)
    for _ in range(3000):
        est.update(g2(4), 4, g2(64), 64)
    assert est.b_simple == pytest.approx(float(expected), rel=0.06)
    # the plain averages agree with the closed forms too
    h = est.history
    assert np.mean([r["g2"] for r in h]) == pytest.approx(float(e.pow(2).sum()), rel=0.06)


def test_callback_logs_b_simple_during_training(tmp_path):
    import json

    from lmstack.scaling.noise_scale import NoiseScaleCallback
    from lmstack.train import TrainConfig, Trainer

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    ids = np.where(
        rng.random(8000) < 0.2, rng.integers(0, 64, 8000), np.tile(np.arange(64), 125)
    ).astype(np.uint16)
    ids.tofile(tmp_path / "t.bin")
    (tmp_path / "t.bin.json").write_text('{"n_tokens": 8000, "dtype": "uint16", "vocab_size": 64}')
    cfg = TrainConfig(
        model=dict(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=16),
        train_data=str(tmp_path / "t.bin"),
        batch_size=2,
        seq_len=16,
        max_steps=6,
        warmup_steps=0,
        out_dir=str(tmp_path / "run"),
        device="cpu",
        precision="fp32",
        eval_interval=0,
        eval_batches=1,
    )
    cb = NoiseScaleCallback(every=2, big=4)
    Trainer(cfg, progress=False).fit(callback=cb)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    ns = [r for r in rows if r["kind"] == "noise_scale"]
    assert [r["step"] for r in ns] == [2, 4, 6]
    assert all(r["b_big_tokens"] == 4 * r["b_small_tokens"] == 128 for r in ns)
    assert cb.estimate.n == 3
