"""The sweep (resumable, rows with exact N/D/C), the runs file (corrupt lines named) and `lmstack scaling fit`."""

import json

import numpy as np
import pytest

from lmstack.cli import main
from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.scaling.runs import RunsFileError, append_run, read_runs
from lmstack.scaling.sweep import Sweep, compute_params, run_sweep
from lmstack.utils import is_png_file

pytestmark = pytest.mark.usefixtures("one_thread")

TRUE = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)


def chinchilla_loss(N, D, E, A, B, alpha, beta):
    """The synthetic runs' law, written here (Hoffmann et al. 2022 eq. 2): E + A/N^α + B/D^β."""
    return E + A / N**alpha + B / D**beta


def _tokens(tmp_path):
    rng = np.random.default_rng(0)
    ids = np.where(
        rng.random(20000) < 0.1, rng.integers(1, 64, 20000), np.tile(np.arange(1, 33), 700)[:20000]
    )
    path = tmp_path / "tokens.bin"
    ids.astype(np.uint16).tofile(path)
    (tmp_path / "tokens.bin.json").write_text(
        json.dumps({"n_tokens": 20000, "dtype": "uint16", "vocab_size": 64})
    )
    return path


SWEEP = """
out_dir = "{out}"
budgets = [2e8, 4e8]
min_steps = 5
eval_points = 2
[train]
train_data = "{data}"
batch_size = 4
seq_len = 16
lr = 1e-2
min_lr = 1e-3
precision = "fp32"
eval_batches = 2
[model]
tie_embeddings = true
[[sizes]]
d_model = 16
n_layers = 1
n_heads = 2
d_ff = 32
[[sizes]]
d_model = 32
n_layers = 1
n_heads = 2
d_ff = 64
"""


def test_compute_params_is_every_parameter_of_a_tied_model():
    cfg = ModelConfig.from_dict(
        dict(d_model=32, n_layers=2, n_heads=2, d_ff=64, vocab_size=64, tie_embeddings=True)
    )
    # tied: the one V·D table is the unembedding's weights; N = all parameters
    assert compute_params(cfg) == sum(p.numel() for p in Transformer(cfg).parameters())


@pytest.mark.slow
def test_sweep_resumes_and_records_6nd(tmp_path):
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(SWEEP.format(out=tmp_path / "out", data=_tokens(tmp_path)))
    sweep = Sweep.load(cfg)
    specs = sweep.plan()
    assert len(specs) == 4
    assert run_sweep(sweep, progress=False, limit=1) == (1, 0)
    first = read_runs(sweep.runs_path)[0]
    assert run_sweep(sweep, progress=False) == (3, 1)  # the finished run is skipped, not retrained
    rows = read_runs(sweep.runs_path)
    assert [r["name"] for r in rows] == [s.name for s in specs]
    assert rows[0] == first
    for r, s in zip(rows, specs):
        assert r["D"] == s.steps * 4 * 16  # steps × B × S
        assert r["C"] == pytest.approx(6 * r["N"] * r["D"])
        assert r["C"] == pytest.approx(r["budget"], rel=0.15)  # D = C/(6N), rounded to whole steps
        assert len(r["curve"]) >= 1 and r["loss"] > 0
        assert r["unique_tokens"] == int(
            20000 * (1 - 0.05)
        )  # U: the training split (default val_fraction)
    assert run_sweep(sweep, progress=False) == (0, 4)


def test_corrupt_line_is_named(tmp_path):
    path = tmp_path / "runs.jsonl"
    append_run(path, {"name": "a", "N": 1e6, "D": 1e7, "C": 6e13, "loss": 3.0})
    with open(path, "a") as f:
        f.write('{"name": "b", "N": 1e6, "D": \n')
    with pytest.raises(RunsFileError, match=r"runs\.jsonl:2: not valid JSON"):
        read_runs(path)
    path.write_text('{"name": "a", "N": 1e6, "D": 1e7, "C": 6e13}\n')
    with pytest.raises(RunsFileError, match=r"runs\.jsonl:1: missing field\(s\) \['loss'\]"):
        read_runs(path)
    path.write_text('{"name": "a", "N": -1, "D": 1e7, "C": 6e13, "loss": 2}\n')
    with pytest.raises(RunsFileError, match=r":1: N=-1 must be a finite number > 0"):
        read_runs(path)


def test_sweep_config_errors_name_the_field(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text('budgets = []\n[[sizes]]\nd_model = 8\n[train]\ntrain_data = "x"\n')
    with pytest.raises(ValueError, match="budgets must be a non-empty list"):
        Sweep.load(cfg)
    cfg.write_text(
        'budgets = [1e9]\nbugdet = 1\n[[sizes]]\nd_model = 8\n[train]\ntrain_data = "x"\n'
    )
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['bugdet'\]"):
        Sweep.load(cfg)


def _synthetic_runs(path):
    """IsoFLOP runs whose losses follow TRUE with 0.3% noise, loss curves along training, one held-out run."""
    rng = np.random.default_rng(0)
    G = (0.34 * 406.4 / (0.28 * 410.7)) ** (1 / 0.62)
    for C in (1e18, 3e18, 1e19, 3e19):
        for f in np.geomspace(1 / 6, 6, 7):
            N = G * (C / 6) ** (0.28 / 0.62) * f
            D = C / (6 * N)
            curve = [
                [6 * N * d, float(chinchilla_loss(N, d, **TRUE))]
                for d in D * np.array([0.25, 0.5, 0.75])
            ]
            append_run(
                path,
                {
                    "name": f"C{C:.0e}_{f:.2f}",
                    "budget": C,
                    "N": N,
                    "D": D,
                    "C": 6 * N * D,
                    "loss": float(chinchilla_loss(N, D, **TRUE) * np.exp(rng.normal(0, 0.003))),
                    "curve": curve,
                },
            )
    N = G * (3e20 / 6) ** (0.28 / 0.62)
    append_run(
        path,
        {
            "name": "held",
            "holdout": True,
            "budget": 3e20,
            "N": N,
            "D": 3e20 / (6 * N),
            "C": 3e20,
            "loss": float(chinchilla_loss(N, 3e20 / (6 * N), **TRUE)),
        },
    )


@pytest.mark.slow
def test_fit_command_predicts_the_held_out_run(tmp_path, capsys):
    runs = tmp_path / "runs.jsonl"
    _synthetic_runs(runs)
    assert main(["scaling", "fit", str(runs), "--bootstrap", "20", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "approach 1" in out and "approach 2" in out and "approach 3" in out
    fit = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert fit["approaches"]["approach 2 (IsoFLOP)"]["a"] == pytest.approx(0.28 / 0.62, abs=0.05)
    assert fit["approaches"]["approach 3 (L(N,D) fit)"]["a"] == pytest.approx(0.28 / 0.62, abs=0.05)
    (held,) = fit["holdout"]
    assert abs(held["error"]) < 0.02  # the aim: held-out loss within 2%
    lo, hi = held["interval"]
    lo_run, hi_run = held["interval_run"]  # adds one run's scatter about the law: wider
    assert lo_run <= lo < hi <= hi_run
    assert fit["repeats"] == "none" and set(fit["backtest"]) == {
        "none"
    }  # no unique_tokens: the plain law
    for name in ("isoflop", "envelope", "contours", "predicted_vs_actual"):
        assert is_png_file(tmp_path / "fit" / f"{name}.png")


def test_plan_command_prints_the_presets(capsys):
    assert main(["scaling", "plan", "--flops", "5.76e23", "--law", "epoch"]) == 0
    out = capsys.readouterr().out
    assert (
        "epoch" in out and "7.22e+10" in out
    )  # Besiroglu et al.'s law at Gopher's budget: ~72B params


def test_exact_flop_budgets_use_accountings_step_count(tmp_path):
    """flops = "exact": steps × (accounting's FLOPs per step, itself tested in tests/accounting) = C within
    half a step; attention's FLOPs make that fewer steps than 6ND would."""
    from lmstack.accounting import training_step_flops

    cfg = tmp_path / "sweep.toml"
    cfg.write_text('flops = "exact"\n' + SWEEP.format(out=tmp_path / "out", data=_tokens(tmp_path)))
    sweep = Sweep.load(cfg)
    for s in sweep.plan():
        step_flops = training_step_flops(sweep.model_config(s.model), 4, 16)
        assert abs(s.steps * step_flops - s.budget) <= step_flops / 2
        assert s.steps < s.budget / (6 * s.N * 64)


def test_a_diverging_run_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """Issue #31: one diverging run (TrainingDiverged) stopped the whole sweep. It is recorded as diverged,
    the other runs train, a rerun does not retry it."""
    import lmstack.scaling.sweep as sweep_mod
    from lmstack.train import TrainingDiverged

    class DivergesAtWidth16(sweep_mod.Trainer):
        def fit(self):
            if self.model_config.d_model == 16:
                raise TrainingDiverged("loss is nan at step 3")
            return super().fit()

    monkeypatch.setattr(sweep_mod, "Trainer", DivergesAtWidth16)
    cfg = tmp_path / "sweep.toml"
    text = SWEEP.format(out=tmp_path / "out", data=_tokens(tmp_path))
    cfg.write_text(text.replace("budgets = [2e8, 4e8]", "budgets = [2e8]"))
    sweep = Sweep.load(cfg)
    assert run_sweep(sweep, progress=False) == (2, 0)
    bad, good = read_runs(sweep.runs_path)  # sizes in file order: d_model 16, then 32
    assert bad["diverged"].startswith("loss is nan at step 3") and bad["loss"] is None
    assert bad["D"] == sweep.plan()[0].D and "diverged" not in good and good["loss"] > 0
    assert run_sweep(sweep, progress=False) == (0, 2)


def test_fit_leaves_diverged_runs_out_and_lists_them(tmp_path):
    """A diverged row (no loss) changes no fitted number; it is listed in fit.json and drawn."""
    from lmstack.scaling.fit_runs import fit_runs

    runs = tmp_path / "runs.jsonl"
    _synthetic_runs(runs)
    rows = read_runs(runs)
    bad = {"name": "bad", "budget": 1e18, "N": 2e6, "D": 1e18 / 12e6, "C": 1e18, "loss": None}
    append_run(runs, {**bad, "diverged": "loss is nan at step 40"})
    clean = fit_runs(rows, tmp_path / "clean", n_boot=0)
    res = fit_runs(read_runs(runs), tmp_path / "with", n_boot=0)
    assert [a.a for a in res.approaches] == [a.a for a in clean.approaches]
    assert [d["name"] for d in res.diverged] == ["bad"]
    assert json.loads((tmp_path / "with" / "fit.json").read_text())["diverged"][0]["name"] == "bad"
    png = "isoflop.png"
    assert (tmp_path / "with" / png).read_bytes() != (tmp_path / "clean" / png).read_bytes()
