"""SFT, DPO, GRPO and expert iteration data parallel under ``torchrun --nproc_per_node=2`` (gloo, CPU) equal one process on the
same global batch: the logged losses, gradient norms, rewards and evaluation, and the final weights (SGD for
SFT/DPO, so equal weights mean equal gradients; AdamW for GRPO and expert iteration), and ``lmstack dpo
--task``'s pair sampling split over the ranks gives the one-process pairs. The reference is the plain single-process
run of the same driver (``align_ddp_driver.py``), in this test's own process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
import align_ddp_driver  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
DRIVER = Path(align_ddp_driver.__file__)
SKIP = ("mfu",)  # and every timing: keys ending in _s (seconds, tokens per second)


def _launch(out: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [str(torchrun), "--standalone", "--nproc_per_node=2", str(DRIVER), str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    align_ddp_driver.main(one, world=1)
    _launch(two)
    return one, two


@pytest.mark.parametrize("name", ["sft", "dpo", *align_ddp_driver.GRPO_RUNS])
def test_two_ranks_equal_one_process(runs, name):
    one, two = runs
    rows1 = json.loads((one / f"{name}.json").read_text())
    rows2 = json.loads((two / f"{name}.json").read_text())
    assert len(rows1) == len(rows2) > 1
    for r1, r2 in zip(rows1, rows2):
        assert r1.keys() == r2.keys()
        for k, v in r1.items():
            if k in SKIP or k.endswith("_s") or not isinstance(v, (int, float)):
                continue
            assert r2[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (name, r1.get("step"), k)
    w1, w2 = (
        load_file(str(one / f"{name}.safetensors")),
        load_file(str(two / f"{name}.safetensors")),
    )
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
    train = [r for r in rows1 if r.get("kind", "train") == "train" and "loss" in r]
    assert train and train[0]["loss"] != train[-1]["loss"]  # it trained


def test_pair_sampling_split_over_ranks_equals_one_process(runs):
    """Each rank samples and verifies its share of the 5 problems (2 + 3, no duplicated work); the gathered
    pairs are the one-process pairs, in problem order."""
    one, two = runs
    run1, run2 = (json.loads((d / "pairs.json").read_text()) for d in (one, two))
    assert run1["shares"] == [5] and run2["shares"] == [2, 3]
    assert run1["pairs"]  # some problems had both an even- and an odd-length sample
    assert run2["pairs"] == run1["pairs"]


def test_expert_iteration_kept_samples_on_both_ranks(runs):
    """Step 1 keeps samples on rank 0 only, step 2 on both: the one-process counts, and the run trained."""
    one, two = runs
    rows = [r for r in json.loads((two / "expert_iteration.json").read_text()) if "kept" in r]
    assert [r["kept"] for r in rows] == [
        r["kept"] for r in json.loads((one / "expert_iteration.json").read_text()) if "kept" in r
    ]
    assert all(r["kept"] > 0 for r in rows)
