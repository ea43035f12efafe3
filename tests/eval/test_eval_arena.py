"""Arena ratings: Bradley–Terry recovers known strengths from simulated battles, equals scipy's fit of the
same likelihood; online Elo orders the models the same way; bad battles files name line and field."""

import json
import math

import numpy as np
import pytest

from lmstack.eval.arena import BattlesError, Battles, bt_fit, online_elo, rate, read_battles, to_elo_scale

TRUE = {"alpha": 1250.0, "beta": 1120.0, "gamma": 1000.0, "delta": 930.0, "eps": 700.0}


def simulate(n, seed=0, tie_rate=0.0):
    rng = np.random.default_rng(seed)
    names = list(TRUE)
    r = np.array([TRUE[m] for m in names])
    a = rng.integers(0, len(names), n)
    b = (a + rng.integers(1, len(names), n)) % len(names)
    p = 1 / (1 + 10 ** ((r[b] - r[a]) / 400))
    s = (rng.random(n) < p).astype(float)
    s[rng.random(n) < tie_rate] = 0.5
    return Battles(names, a, b, s)


def test_bt_equals_scipy_mle():
    from scipy.optimize import minimize

    bat = simulate(600, seed=1, tie_rate=0.1)
    M, n, ridge = len(bat.models), len(bat.score), 1e-6

    def nll(beta):
        d = beta[bat.a] - beta[bat.b]
        return float(-(bat.score * -np.logaddexp(0, -d) + (1 - bat.score) * -np.logaddexp(0, d)).sum()
                     + ridge * n / 2 * beta @ beta)

    ref = minimize(nll, np.zeros(M), method="BFGS", options={"gtol": 1e-9}).x
    got = bt_fit(bat.a, bat.b, bat.score, M, ridge=ridge)
    assert got == pytest.approx(ref - ref.mean(), abs=1e-4)


def test_bt_is_consistent_and_elo_orders_alike():
    bat = simulate(100_000, seed=5)
    true = np.array([TRUE[m] for m in bat.models])  # mean 1000 already: the fit is centred at 1000 too
    res = rate(bat, n_bootstrap=0, progress=False)
    assert np.abs(res.bt - true).max() < 5
    # online Elo (one ordered pass) ranks them the same way
    assert list(np.argsort(-res.elo)) == list(np.argsort(-true))


@pytest.mark.slow
def test_bt_intervals_cover_true_strengths():
    """Over 10 simulated arenas of 3000 battles, the 95% bootstrap intervals hold the true ratings at
    about their nominal rate (measured: 92 of 100 intervals, 20 arenas of 4000 battles, 100 resamples)."""
    hits, total = 0, 0
    for seed in range(10):
        bat = simulate(3000, seed=seed)
        res = rate(bat, n_bootstrap=60, seed=seed, progress=False)
        true = np.array([TRUE[m] for m in bat.models])
        hits += int(np.sum((res.ci_low <= true) & (true <= res.ci_high)))
        total += len(true)
        assert np.abs(res.bt - true).max() < 60
    assert hits / total >= 0.84


def test_online_elo_worked_example():
    # two 1000-rated models: a wins, E = 0.5, so a gains K/2 = 2 and b loses 2; then a tie: E_a = 1/(1+10^(-4/400))
    bat = Battles(["a", "b"], np.array([0, 0]), np.array([1, 1]), np.array([1.0, 0.5]))
    e = 1 / (1 + 10 ** (-4 / 400))
    r = online_elo(bat, k=4)
    assert r[0] == pytest.approx(1002 + 4 * (0.5 - e)) and r[1] == pytest.approx(998 - 4 * (0.5 - e))
    assert to_elo_scale(np.array([math.log(10)]))[0] == pytest.approx(1400)


def _write(tmp_path, rows):
    p = tmp_path / "battles.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def test_bad_battles(tmp_path):
    ok = {"model_a": "x", "model_b": "y", "winner": "model_a"}
    with pytest.raises(BattlesError, match=r"battles\.jsonl:2: field 'winner' = 'modle_b' must be one of"):
        read_battles(_write(tmp_path, [ok, {**ok, "winner": "modle_b"}]))
    with pytest.raises(BattlesError, match=r"battles\.jsonl:1: missing field 'model_b'"):
        read_battles(_write(tmp_path, [{"model_a": "x", "winner": "tie"}]))
    with pytest.raises(BattlesError, match=r"battles\.jsonl:3: not valid JSON"):
        read_battles(_write(tmp_path, [ok, "", "{"]))
    with pytest.raises(BattlesError, match=r"no battles"):
        read_battles(_write(tmp_path, []))
    with pytest.raises(BattlesError, match=r":1: model_a and model_b are both 'x'"):
        read_battles(_write(tmp_path, [{**ok, "model_b": "x"}]))
    bat = read_battles(_write(tmp_path, [ok, ok, {**ok, "model_b": "yy"}]))  # 'yy' once: a typo of 'y'?
    assert bat.warnings == [f"{tmp_path / 'battles.jsonl'}:3: model 'yy' appears in only one battle "
                            "(a typo of another name?)"]


def test_arena_cli(tmp_path, capsys):
    from lmstack.cli import main
    from lmstack.utils import is_png_file

    bat = simulate(300, seed=3, tie_rate=0.1)
    w = {1.0: "model_a", 0.0: "model_b", 0.5: "tie"}
    p = _write(tmp_path, [{"model_a": bat.models[i], "model_b": bat.models[j], "winner": w[s]}
                          for i, j, s in zip(bat.a, bat.b, bat.score)])
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["eval", "arena", str(p), "--bootstrap", "20", "--json", str(out), "--png", str(png)]) == 0
    d = json.loads(out.read_text())
    assert d["n_battles"] == 300 and len(d["ratings"]) == 5 and is_png_file(png)
    assert all(r["ci_low"] <= r["bradley_terry"] <= r["ci_high"] for r in d["ratings"])
    assert "Bradley-Terry" in capsys.readouterr().out
    assert main(["eval", "arena", str(tmp_path / "none.jsonl")]) == 2
