"""Arena ratings: Bradley–Terry recovers known strengths from simulated battles, equals scipy's fit of the
same likelihood; online Elo orders the models the same way; bad battles files name line and field."""

import json
import math

import numpy as np
import pytest

from lmstack.eval.arena import (
    Battles,
    BattlesError,
    bt_fit,
    online_elo,
    rate,
    read_battles,
    to_elo_scale,
)

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
        return float(
            -(bat.score * -np.logaddexp(0, -d) + (1 - bat.score) * -np.logaddexp(0, d)).sum()
            + ridge * n / 2 * beta @ beta
        )

    ref = minimize(nll, np.zeros(M), method="BFGS", options={"gtol": 1e-9}).x
    got = bt_fit(bat.a, bat.b, bat.score, M, ridge=ridge)
    assert got == pytest.approx(ref - ref.mean(), abs=1e-4)


def test_bt_is_consistent_and_elo_orders_alike():
    bat = simulate(100_000, seed=5)
    true = np.array(
        [TRUE[m] for m in bat.models]
    )  # mean 1000 already: the fit is centred at 1000 too
    res = rate(bat, n_bootstrap=0, progress=False)
    assert np.abs(res.bt - true).max() < 5
    # online Elo (one ordered pass) ranks them the same way
    assert list(np.argsort(-res.elo)) == list(np.argsort(-true))


@pytest.mark.parametrize("level", [0.95, 0.8])
def test_bt_interval_is_the_bootstrap_percentiles_at_the_level(level):
    bat = simulate(400, seed=2)
    res = rate(bat, n_bootstrap=200, seed=7, level=level, progress=False)
    # the resamples again, here: the same generator draws the same battle indices; bt_fit is checked
    # against scipy's optimiser above
    rng, M, n = np.random.default_rng(7), len(bat.models), len(bat.score)
    boots = []
    for _ in range(200):
        i = rng.integers(0, n, n)
        boots.append(to_elo_scale(bt_fit(bat.a[i], bat.b[i], bat.score[i], M)))
    boots = np.array(boots)  # (200, M)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(boots, [tail, 100 - tail], axis=0)
    np.testing.assert_allclose(res.ci_low, lo, rtol=1e-9)
    np.testing.assert_allclose(res.ci_high, hi, rtol=1e-9)
    inside = ((boots >= res.ci_low) & (boots <= res.ci_high)).mean(axis=0)
    assert inside == pytest.approx(np.full(M, level), abs=0.015)


THREE = {"a": 1100.0, "b": 1000.0, "c": 900.0}


@pytest.mark.slow
def test_bt_intervals_cover_true_strengths():
    """200 simulated arenas of 300 battles among 3 models, 100 resamples each: the 95% intervals hold the
    true ratings 564 of 600 times (0.94, measured; binomial s.e. ~0.01). The same intervals at q = 1 − level
    (a 90% interval labelled 95%) hold them 0.893 of the time."""
    names = list(THREE)
    r = np.array([THREE[m] for m in names])
    hits = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        a = rng.integers(0, 3, 300)
        b = (a + rng.integers(1, 3, 300)) % 3
        s = (rng.random(300) < 1 / (1 + 10 ** ((r[b] - r[a]) / 400))).astype(float)
        res = rate(Battles(names, a, b, s), n_bootstrap=100, seed=seed, progress=False)
        hits += int(np.sum((res.ci_low <= r) & (r <= res.ci_high)))
    assert 0.92 <= hits / 600 <= 0.98


def test_online_elo_worked_example():
    # two 1000-rated models: a wins, E = 0.5, so a gains K/2 = 2 and b loses 2; then a tie: E_a = 1/(1+10^(-4/400))
    bat = Battles(["a", "b"], np.array([0, 0]), np.array([1, 1]), np.array([1.0, 0.5]))
    e = 1 / (1 + 10 ** (-4 / 400))
    r = online_elo(bat, k=4)
    assert r[0] == pytest.approx(1002 + 4 * (0.5 - e)) and r[1] == pytest.approx(
        998 - 4 * (0.5 - e)
    )
    assert to_elo_scale(np.array([math.log(10)]))[0] == pytest.approx(1400)


def _write(tmp_path, rows):
    p = tmp_path / "battles.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def test_bad_battles(tmp_path):
    ok = {"model_a": "x", "model_b": "y", "winner": "model_a"}
    with pytest.raises(
        BattlesError, match=r"battles\.jsonl:2: field 'winner' = 'modle_b' must be one of"
    ):
        read_battles(_write(tmp_path, [ok, {**ok, "winner": "modle_b"}]))
    with pytest.raises(BattlesError, match=r"battles\.jsonl:1: missing field 'model_b'"):
        read_battles(_write(tmp_path, [{"model_a": "x", "winner": "tie"}]))
    with pytest.raises(BattlesError, match=r"battles\.jsonl:3: not valid JSON"):
        read_battles(_write(tmp_path, [ok, "", "{"]))
    with pytest.raises(BattlesError, match=r"no battles"):
        read_battles(_write(tmp_path, []))
    with pytest.raises(BattlesError, match=r":1: model_a and model_b are both 'x'"):
        read_battles(_write(tmp_path, [{**ok, "model_b": "x"}]))
    bat = read_battles(
        _write(tmp_path, [ok, ok, {**ok, "model_b": "yy"}])
    )  # 'yy' once: a typo of 'y'?
    assert bat.warnings == [
        f"{tmp_path / 'battles.jsonl'}:3: model 'yy' appears in only one battle "
        "(a typo of another name?)"
    ]


def test_arena_cli(tmp_path, capsys):
    from lmstack.cli import main
    from lmstack.utils import is_png_file

    bat = simulate(300, seed=3, tie_rate=0.1)
    w = {1.0: "model_a", 0.0: "model_b", 0.5: "tie"}
    p = _write(
        tmp_path,
        [
            {"model_a": bat.models[i], "model_b": bat.models[j], "winner": w[s]}
            for i, j, s in zip(bat.a, bat.b, bat.score)
        ],
    )
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert (
        main(["eval", "arena", str(p), "--bootstrap", "20", "--json", str(out), "--png", str(png)])
        == 0
    )
    d = json.loads(out.read_text())
    assert d["n_battles"] == 300 and len(d["ratings"]) == 5 and is_png_file(png)
    assert all(r["ci_low"] <= r["bradley_terry"] <= r["ci_high"] for r in d["ratings"])
    assert "Bradley-Terry" in capsys.readouterr().out
    assert main(["eval", "arena", str(tmp_path / "none.jsonl")]) == 2


def _battles(names, pairs):
    """Battles from (i, j, score) triples."""
    a, b, s = (np.array(v) for v in zip(*pairs))
    return Battles(names, a, b, s.astype(float))


def test_separated_battles_warn_and_use_the_prior_hand_worked():
    """Issue #31: perfectly separated battles gave an estimate (12,313.8) outside its own 95% interval
    [1000.0, 3428.9] and no warning. Hand-worked: a beats b in all 10 battles; with the N(0, 1) prior the
    posterior mode has β_a = −β_b = d/2 where 10·(1 − σ(d)) = d/2 (the log-likelihood's slope equals the
    prior's), so a = 1000 + 400/ln 10 · d/2; every resample is the same 10 battles: the interval is the point."""
    from scipy.optimize import brentq

    res = rate(_battles(["a", "b"], [(0, 1, 1.0)] * 10), n_bootstrap=20, progress=False)
    d = brentq(lambda d: 10 * (1 - 1 / (1 + math.exp(-d))) - d / 2, 0.0, 20.0)  # 2.128
    want = 1000 + 400 / math.log(10) * d / 2  # 1184.8
    assert res.bt == pytest.approx([want, 2000 - want], abs=1e-6)
    assert res.ci_low == pytest.approx(res.bt) and res.ci_high == pytest.approx(res.bt)
    assert any("perfect separation" in w and "{a}" in w and "{b}" in w for w in res.warnings)


def test_a_separated_chain_is_the_scipy_map_fit_inside_its_interval():
    """a beats b, b beats c, a beats c, 5 times each: no finite MLE; the rating is scipy's minimum of the
    negative log-likelihood + ½||β||², and lies inside its bootstrap interval."""
    from scipy.optimize import minimize

    bat = _battles(["a", "b", "c"], [(0, 1, 1.0), (1, 2, 1.0), (0, 2, 1.0)] * 5)

    def nll(beta):
        d = beta[bat.a] - beta[bat.b]
        return float(np.logaddexp(0, -d).sum() + 0.5 * beta @ beta)

    ref = minimize(nll, np.zeros(3), method="BFGS", options={"gtol": 1e-10}).x
    res = rate(bat, n_bootstrap=200, progress=False)
    assert res.bt == pytest.approx(to_elo_scale(ref - ref.mean()), abs=1e-3)
    assert np.all((res.ci_low <= res.bt) & (res.bt <= res.ci_high))
    assert any("perfect separation" in w for w in res.warnings)


def test_a_disconnected_comparison_graph_is_named_and_ties_are_not_separation():
    # {a, b} and {c, d} never met; within each a win each way, or a win and a tie: both directions
    bat = _battles(["a", "b", "c", "d"], [(0, 1, 1.0), (0, 1, 0.0), (2, 3, 1.0), (2, 3, 0.5)])
    (w,) = rate(bat, n_bootstrap=0, progress=False).warnings
    assert "disconnected" in w and "{a, b}, {c, d} never met" in w
    assert rate(simulate(300, seed=3), n_bootstrap=0, progress=False).warnings == []
