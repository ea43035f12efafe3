"""Trainer: overfitting, accumulation, mixed precision, determinism, divergence stop, config errors, CLI."""

import json
import math

import pytest
import torch
from conftest import tiny_config, write_tokens

from lmstack.model import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.train import (
    AdamW,
    TrainConfig,
    TrainConfigError,
    Trainer,
    TrainingDiverged,
    cross_entropy,
)
from lmstack.train.data import Batch


def test_tiny_model_overfits_a_short_sequence():
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32)
    model = Transformer(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 50, (1, 17), generator=g)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(150):
        ce, _ = cross_entropy(model(seq[:, :-1]), seq[:, 1:])
        opt.zero_grad()
        ce.backward()
        opt.step()
    assert ce.item() < 0.05


def test_fit_writes_metrics_curve_and_is_deterministic(token_file, tmp_path):
    runs = []
    for name in ("a", "b"):
        t = Trainer(
            tiny_config(token_file, tmp_path / name, eval_interval=5, max_steps=10), progress=False
        )
        summary = t.fit()
        runs.append(
            [
                json.loads(line)
                for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            ]
        )
        assert summary["step"] == 10 and math.isfinite(summary["val_loss"])
        assert summary["val_ppl"] == pytest.approx(math.exp(summary["val_loss"]))
    strip = lambda rows: [
        {k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")} for r in rows
    ]  # noqa: E731
    assert strip(runs[0]) == strip(runs[1])  # same seed -> same losses, same validation
    assert [r["step"] for r in runs[0] if r["kind"] == "eval"] == [5, 10]
    train = [r["loss"] for r in runs[0] if r["kind"] == "train"]
    assert train[-1] < train[0]
    png = t.plot(baseline=t.unigram_baseline())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "b" / "checkpoints" / "step_00000010").is_dir()


class _FixedBatches(Trainer):
    """Feeds a fixed list of micro-batches instead of random windows."""

    batches: list[Batch] = []

    def next_batch(self):
        return self.batches.pop(0)


def test_gradient_accumulation_equals_one_big_batch(token_file, tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 64, (4, 17), generator=g)
    full = Batch(w[:, :-1], w[:, 1:])
    halves = [Batch(w[:2, :-1], w[:2, 1:]), Batch(w[2:, :-1], w[2:, 1:])]
    kw = dict(
        optimizer="sgd",
        momentum=0.0,
        weight_decay=0.0,
        grad_clip=0.0,
        warmup_steps=0,
        lr=0.5,
        min_lr=0.5,
    )
    a = _FixedBatches(
        tiny_config(token_file, tmp_path / "a", batch_size=4, grad_accum=1, **kw), progress=False
    )
    a.batches = [full]
    b = _FixedBatches(
        tiny_config(token_file, tmp_path / "b", batch_size=2, grad_accum=2, **kw), progress=False
    )
    b.batches = list(halves)
    ma, mb = a.train_step(), b.train_step()
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5)
    for pa, pb in zip(a.raw_model.parameters(), b.raw_model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_keeps_fp32_master_weights_and_grads(token_file, tmp_path):
    t = Trainer(tiny_config(token_file, tmp_path, precision="bf16"), progress=False)
    ref = Trainer(tiny_config(token_file, tmp_path / "ref", precision="fp32"), progress=False)
    batch = t.next_batch()
    ce, _ = t.forward_loss(batch)
    ce.backward()
    assert all(
        p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in t.raw_model.parameters()
    )
    ref_ce, _ = ref.forward_loss(batch)
    assert ce.item() == pytest.approx(ref_ce.item(), rel=2e-2)  # bf16 matmuls: close, not equal


def test_activation_checkpointing_gives_the_same_step(token_file, tmp_path):
    a = Trainer(tiny_config(token_file, tmp_path / "a"), progress=False)
    b = Trainer(
        tiny_config(token_file, tmp_path / "b", activation_checkpointing=True), progress=False
    )
    assert b.raw_model.activation_checkpointing
    for _ in range(2):
        assert a.train_step()["loss"] == pytest.approx(b.train_step()["loss"], rel=1e-6)


class _NaNAtStep3(Trainer):
    def forward_loss(self, batch):
        ce, z = super().forward_loss(batch)
        return (ce * float("nan"), z) if self.step == 3 else (ce, z)


def test_nan_loss_stops_and_saves_last_good_state(token_file, tmp_path):
    t = _NaNAtStep3(tiny_config(token_file, tmp_path, max_steps=10), progress=False)
    with pytest.raises(
        TrainingDiverged, match=r"loss is nan at step 3.*last good state \(step 3\)"
    ):
        t.fit()
    path = tmp_path / "checkpoints" / "step_00000003"
    assert path.is_dir()
    fresh = Trainer(tiny_config(token_file, tmp_path / "fresh"), progress=False)
    fresh.resume(path)
    assert all(torch.isfinite(p).all() for p in fresh.raw_model.parameters())


def test_z_loss_and_qk_norm_switches(token_file, tmp_path):
    t = Trainer(tiny_config(token_file, tmp_path, z_loss=1e-3, qk_norm=True), progress=False)
    assert t.raw_model.blocks[0].attn.q_norm is not None
    m = t.train_step()
    assert m["z_loss"] > 0


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(batch_size=0), "batch_size=0"),
        (dict(lr=-1.0), "lr=-1.0"),
        (dict(min_lr=1.0, lr=0.1), "min_lr=1.0 must be <= lr=0.1"),
        (dict(precision="int3"), "precision='int3'"),
        (dict(warmup_steps=50, max_steps=10), "warmup_steps=50 exceeds max_steps=10"),
        (dict(schedule="wsd", decay_steps=0), "decay_steps=0"),
        (dict(packing=True), "packing=true needs sep_id"),
        (dict(optimizer="lion"), "optimizer='lion'"),
        (dict(quant="int4"), "quant='int4'.*int4-qat"),
    ],
)
def test_bad_config_values_give_clear_errors(token_file, tmp_path, changes, message):
    with pytest.raises(TrainConfigError, match=message):
        tiny_config(token_file, tmp_path, **changes)


def test_bad_model_and_data_combinations(token_file, tmp_path):
    with pytest.raises(TrainConfigError, match="n_heads=3 does not divide d_model=32"):
        Trainer(
            tiny_config(
                token_file, tmp_path, model=dict(d_model=32, n_layers=1, n_heads=3, d_ff=64)
            )
        )
    with pytest.raises(TrainConfigError, match="seq_len=16 exceeds model.max_seq_len=8"):
        Trainer(
            tiny_config(
                token_file,
                tmp_path,
                model=dict(d_model=32, n_layers=1, n_heads=4, d_ff=64, max_seq_len=8),
            )
        )
    with pytest.raises(TrainConfigError, match="vocab_size=64 exceeds model.vocab_size=10"):
        Trainer(
            tiny_config(
                token_file,
                tmp_path,
                model=dict(vocab_size=10, d_model=32, n_layers=1, n_heads=4, d_ff=64),
            )
        )
    small = write_tokens(tmp_path / "small.bin", list(range(10)), 64)
    with pytest.raises(TrainConfigError, match="fewer than seq_len"):
        Trainer(tiny_config(small, tmp_path))
    with pytest.raises(ValueError, match="device='tpu9'"):
        Trainer(tiny_config(token_file, tmp_path, device="tpu9"))


def test_config_file_overrides_and_unknown_keys(token_file, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'train_data = "{token_file}"\nlr = 0.01\n[model]\nd_model = 32\nn_layers = 1\nn_heads = 4\n'
    )
    c = TrainConfig.load(toml, ["lr=3e-3", "model.n_layers=2", "packing=true", "sep_id=0"])
    assert c.lr == 3e-3 and c.model["n_layers"] == 2 and c.packing is True
    with pytest.raises(TrainConfigError, match=r"unknown key\(s\) \['learning_rate'\]"):
        TrainConfig.load(toml, ["learning_rate=1"])
    with pytest.raises(TrainConfigError, match="must look like key=value"):
        TrainConfig.load(toml, ["lr"])
    with pytest.raises(TrainConfigError, match="unknown ModelConfig field"):
        TrainConfig.load(toml, ["model.width=3"]).model_config(64)


def test_cli_trains_and_reports(token_file, tmp_path, capsys):
    from lmstack.cli import main

    cfg = tmp_path / "run.json"
    cfg.write_text(
        json.dumps(
            tiny_config(token_file, tmp_path / "out", max_steps=4, packing=True, sep_id=0).to_dict()
        )
    )
    assert main(["train", "--config", str(cfg), "--no-progress", "max_steps=4"]) == 0
    out = capsys.readouterr().out
    assert "validation loss" in out and "unigram baseline" in out
    assert (tmp_path / "out" / "loss_curve.png").is_file()
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()
    assert main(["train", "--config", str(cfg), "--no-progress", "max_steps=6", "--resume"]) == 0
    assert "resumed at step 4" in capsys.readouterr().out
    assert main(["train", "--config", str(cfg), "batch_size=-2"]) == 2
    assert "batch_size=-2" in capsys.readouterr().err


def test_fp16_uses_a_grad_scaler_and_resumes_it(token_file, tmp_path):
    t = Trainer(tiny_config(token_file, tmp_path, precision="fp16"), progress=False)
    assert t.scaler is not None
    losses = [t.train_step()["loss"] for _ in range(3)]
    assert all(math.isfinite(v) for v in losses)
    path = t.save_checkpoint()
    u = Trainer(tiny_config(token_file, tmp_path / "u", precision="fp16"), progress=False)
    u.resume(path)
    assert u.scaler.get_scale() == t.scaler.get_scale()


def test_set_max_steps_from_a_callback_moves_the_end_and_the_schedule(token_file, tmp_path):
    from lmstack.train import cosine_lr

    t = Trainer(tiny_config(token_file, tmp_path, max_steps=10, warmup_steps=2), progress=False)
    lrs = {}

    def cb(trainer, m):
        lrs[trainer.step] = m["lr"]
        if trainer.step == 2:
            trainer.set_max_steps(5)

    assert t.fit(callback=cb)["step"] == 5
    assert lrs[4] == pytest.approx(
        cosine_lr(3, 1e-2, 1e-3, 2, 5)
    )  # the update of step 4 used lr(t=3)
    with pytest.raises(ValueError, match="max_steps=3 must be > the current step 5"):
        t.set_max_steps(3)


def test_attention_backend_is_a_runtime_choice_decided_once(token_file, tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'train_data = "{token_file}"\n[model]\nd_model = 32\nn_layers = 1\nn_heads = 4\n'
        'attn_backend = "reference"\n'
    )
    c = TrainConfig.load(
        toml
    )  # the old spelling, [model] attn_backend, is still read: it moves to the top level
    assert (
        c.attn_backend == "reference"
        and "attn_backend" not in c.model
        and c.runtime().attn_backend == "reference"
    )
    assert TrainConfig.load(toml, ["attn_backend=reference"]).attn_backend == "reference"
    with pytest.raises(
        TrainConfigError, match="model.attn_backend='reference' and attn_backend='sdpa' disagree"
    ):
        TrainConfig.load(toml, ["attn_backend=sdpa"])
    with pytest.raises(TrainConfigError, match="attn_backend='flash9'"):
        TrainConfig.load(toml, ["attn_backend=flash9"])
    # auto is resolved once when the trainer is built, for CPU bf16 autocast at seq_len <= 512, and logged
    t = Trainer(tiny_config(token_file, tmp_path, precision="bf16"), progress=False)
    assert t.raw_model.attention.name == "matmul"
    assert "attention: matmul (auto: CPU, bf16 autocast, ≤512 keys)" in capsys.readouterr().out


def test_quantisation_aware_training_from_the_config(token_file, tmp_path):
    """``quant = "int4-qat"``: the trainer's block linears compute with the int4 round trip of their master
    weights (``quantize_int4`` / ``dequantize_int4``, written independently of QAT), and training moves them."""
    import torch.nn.functional as F

    from lmstack.quant import dequantize_int4, quantize_int4
    from lmstack.train import Trainer

    t = Trainer(tiny_config(token_file, tmp_path, quant="int4-qat", max_steps=3), progress=False)
    lin = t.raw_model.blocks[0].attn.q_proj
    before = lin.weight.detach().clone()
    x = torch.randn(3, lin.in_features)
    w_hat = dequantize_int4(*quantize_int4(lin.weight.detach(), 32))
    torch.testing.assert_close(lin(x), F.linear(x, w_hat))
    t.fit()
    assert not torch.equal(lin.weight.detach(), before)
