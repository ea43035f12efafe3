"""The import contracts of pyproject's ``[tool.importlinter]`` hold for lmstack, and a forbidden import breaks them."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lmstack

pytest.importorskip("importlinter")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
PACKAGE = Path(lmstack.__file__).resolve().parent  # the lmstack these tests import
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(sys.argv[1], no_cache=True))"


def lint(src: Path) -> subprocess.CompletedProcess:
    """Run the linter with pyproject's contracts on the ``lmstack`` package found in ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [sys.executable, "-c", LINT, str(PYPROJECT)],
        env=env,
        cwd=src,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_package_keeps_every_contract():
    out = lint(PACKAGE.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " 0 broken" in out.stdout and "BROKEN" not in out.stdout


@pytest.mark.parametrize(
    "module,source,contract",
    [
        (
            "model/bad_cli_import.py",
            "from lmstack.inference.cli import register\n",
            "library code never imports a command-line module",
        ),
        (
            "tokenizer/bad_model_import.py",
            "from lmstack.model.config import ModelConfig\n",
            "the tokenizer imports no other chapter",
        ),
        (
            "parallel/bad_train_import.py",
            "def f():\n    from lmstack.train.trainer import Trainer\n",  # hidden in a function
            "parallelism wraps a plain model",
        ),
        (
            "ops/bad_model_import.py",
            "from lmstack.model.seam import AttentionMetadata\n",
            "ops (the GEMM dispatch under the model's linears) imports no chapter",
        ),
        # the mixer specs accounting reads must stay arithmetic on the config: a torch module behind them breaks it
        (
            "model/mixer_spec.py",
            "from lmstack.model.layers import Linear\n",
            "accounting imports nothing of the model but its pure declarations",
        ),
    ],
)
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, source, contract):
    copy = tmp_path / "src" / "lmstack"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / module).write_text(source)
    out = lint(copy.parent)
    assert out.returncode == 1, out.stdout + out.stderr
    verdict = re.search(re.escape(contract) + r".*?(KEPT|BROKEN)", " ".join(out.stdout.split()))
    assert verdict and verdict.group(1) == "BROKEN", out.stdout
    assert (
        module.replace("/", ".").removesuffix(".py") in out.stdout
    )  # the report names the offending module
