"""lm-eval's own ``lm_eval`` command finds ``--model lmstack`` once lmstack is installed: the package ships
``lmstack-lm-eval.pth`` (src/lmstack/_lm_eval_hook.py). Here the .pth is put in a fresh site directory
(``site.addsitedir`` processes it exactly as interpreter start-up does for site-packages) and the real
``lm_eval`` console script of this environment runs in a subprocess on a locally defined task; its
accuracy and per-option log-likelihoods equal lmstack's own runner on the same items."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install 'lmstack[test]'")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ROWS = [
    {"question": q, "choices": c, "answer": a}
    for q, c, a in [
        ("the cat is", ["at the hat", "this", "the theatre"], 0),
        ("where is the hat?", ["at the cat", "the", "heart"], 2),
        ("this is", ["a cat", "a hat", "the cat sat"], 1),
        ("A: the", ["cat", "hat", "theatre", "is"], 3),
        ("is this the cat?", ["yes", "no"], 0),
        ("hat or cat", ["hat", "cat"], 1),
    ]
]
LM_EVAL_MC = """task: lmstack_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""
PTH = ROOT / "src" / "lmstack-lm-eval.pth"


def _lm_eval_script() -> str:
    p = Path(sys.executable).parent / "lm_eval"
    found = str(p) if p.exists() else shutil.which("lm_eval")
    if found is None:
        pytest.skip("no lm_eval console script next to this interpreter or on PATH")
    return found


def _run(site_dir, code: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    env.pop("LMSTACK_NO_LM_EVAL_HOOK", None)
    prelude = f"import site, sys, runpy\nsite.addsitedir({str(site_dir)!r})\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture
def site_dir(tmp_path):
    d = tmp_path / "site"
    d.mkdir()
    shutil.copy(PTH, d / PTH.name)
    return d


def test_registration_is_lazy(site_dir, tmp_path):
    """The hook registers a placeholder when lm_eval.models loads; nothing of lmstack.eval or torch is
    imported until lm-eval resolves the name, and lm-eval's own names are all still there."""
    r = _run(
        site_dir,
        (
            "import lm_eval.models\n"
            "from lm_eval.api.registry import model_registry, get_model\n"
            "print(model_registry._objs['lmstack'], 'torch' in sys.modules, 'lmstack.eval' in sys.modules)\n"
            "print(get_model('lmstack').__module__, get_model('hf').__name__)\n"
        ),
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [
        "lmstack.eval.harness:LMStackLM",
        "False",
        "False",
        "lmstack.eval.harness",
        "HFLM",
    ]


def test_without_the_pth_lm_eval_does_not_know_lmstack(tmp_path):
    """The control: the same interpreter without the .pth has no 'lmstack' model (so the hook is what adds it)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _run(
        empty,
        "import lm_eval.models\nfrom lm_eval.api.registry import model_registry\n"
        "print('lmstack' in model_registry)\n",
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    import site

    if any((Path(d) / PTH.name).exists() for d in site.getsitepackages()):
        assert r.stdout.split() == [
            "True"
        ]  # this environment has the new package installed already
    else:
        assert r.stdout.split() == ["False"]


def test_real_lm_eval_cli_equals_runner(site_dir, tiny_dir, lm, tmp_path):
    from lmstack.eval.runner import Evaluator, run_task
    from lmstack.eval.tasks import load_task

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "lmstack_local_mc.yaml").write_text(LM_EVAL_MC.format(data=data))
    out = tmp_path / "out"
    argv = [
        "lm_eval",
        "--model",
        "lmstack",
        "--model_args",
        f"model={tiny_dir}",
        "--tasks",
        "lmstack_local_mc",
        "--include_path",
        str(tmp_path / "tasks"),
        "--output_path",
        str(out),
        "--log_samples",
        "--device",
        "cpu",
    ]
    r = _run(
        site_dir,
        f"sys.argv = {argv!r}\nrunpy.run_path({_lm_eval_script()!r}, run_name='__main__')\n",
        tmp_path,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    (result,) = out.rglob("results_*.json")
    got = json.loads(result.read_text())["results"]["lmstack_local_mc"]
    spec = tmp_path / "mine.yaml"
    spec.write_text(f'data: {data.name}\nprompt: "Q: {{question}}\\nA:"\n')
    mine = run_task(load_task(spec), Evaluator(*lm), progress=False)
    assert got["acc,none"] == pytest.approx(mine.metrics["acc"])
    assert got["acc_norm,none"] == pytest.approx(mine.metrics["acc_norm"])
    (samples,) = out.rglob("samples_lmstack_local_mc_*.jsonl")
    rows = sorted(
        (json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s["doc_id"]
    )
    for s, m in zip(rows, mine.samples, strict=True):
        assert [float(x[0][0]) for x in s["resps"]] == pytest.approx(m["loglik"], rel=1e-6)


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_package_ships_the_pth(kind, tmp_path):
    """setup.py puts the .pth at the top of both a regular and an editable wheel (site-packages on install)."""
    src = tmp_path / "project"  # a copy: the build writes build/ and *.egg-info next to the sources
    shutil.copytree(
        ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    for f in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / f, src / f)
    code = f"from setuptools import build_meta as b\nprint(b.build_{kind}({str(tmp_path)!r}))\n"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=src,
        env=dict(os.environ, PYTHONPATH=""),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(whl) as z:
        assert z.read("lmstack-lm-eval.pth").decode().strip() == "import lmstack._lm_eval_hook"
        if kind == "wheel":
            assert "lmstack/_lm_eval_hook.py" in z.namelist()
