"""Issue 13, checkpoints: kill -9 at random moments and at the dangerous points of a save never
leaves an unloadable ``latest``, and the resumed run ends with exactly the weights of an
uninterrupted run (torch.equal); the two data-loss sequences of the issue; disk full; leftovers;
``latest`` naming a missing checkpoint; metrics rows of replayed steps logged once."""

from __future__ import annotations

import errno
import json
import random
import signal
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from reliability_train_helpers import (
    assert_same_weights,
    one_thread,
    run_config,
    snapshot,
    spawn,
    train_cli,
    weights,
)

from lmstack.train import checkpoint as ckpt
from lmstack.train.checkpoint import latest_checkpoint, read_checkpoint

DRIVER = str(Path(__file__).with_name("reliability_kill_driver.py"))


def _reference(tmp: Path, config: Path, *overrides: str) -> dict[str, torch.Tensor]:
    """The final weights of an uninterrupted run with these overrides (its own out_dir)."""
    out = tmp / f"ref_{abs(hash(overrides))}"
    if not out.exists():
        rc, _, err = train_cli(config, f"out_dir={out}", *overrides)
        assert rc == 0, err
    return weights(latest_checkpoint(out / "checkpoints"))


def _train_rows(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]


def _logged(run: Path) -> int:
    """metrics.jsonl's modification time (ns), 0 when absent."""
    try:
        return (run / "metrics.jsonl").stat().st_mtime_ns
    except FileNotFoundError:
        return 0


def _assert_latest_loadable(ckdir: Path) -> Path:
    p = latest_checkpoint(ckdir)
    assert p is not None
    ck = read_checkpoint(p)
    assert ck["meta"]["step"] == int(
        p.name.split("_")[2] if p.name.startswith(".old_") else p.name[5:]
    )
    return p


def _drive(point: str, step: int, config: Path, *args: str) -> int:
    proc = spawn(
        [
            sys.executable,
            DRIVER,
            point,
            str(step),
            "--",
            "--config",
            str(config),
            "--no-progress",
            "--threads",
            "1",
            *args,
        ]
    )
    _, err = proc.communicate(timeout=120)
    if proc.returncode != -signal.SIGKILL:
        raise AssertionError(
            f"the driver was not killed at {point}: rc={proc.returncode}\n{err.decode()}"
        )
    return proc.returncode


# ---- kill -9 at the dangerous points ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("point,step", [("after_rename", 4), ("mid_prune", 6)])
def test_kill_at_dangerous_point_then_resume_is_bit_exact(tmp_path, point, step):
    config = run_config(tmp_path)
    run = tmp_path / "run"
    common = [f"out_dir={run}", "max_steps=8", "ckpt_interval=2", "keep_last=2"]
    _drive(point, step, config, *common)
    p = _assert_latest_loadable(run / "checkpoints")
    for q in ckpt.step_dirs(
        run / "checkpoints"
    ):  # every step folder is complete (pruned ones are renamed first)
        read_checkpoint(q)
    # after the rename the new folder is complete but latest still names the previous one
    assert p.name == (f"step_{step - 2:08d}" if point == "after_rename" else f"step_{step:08d}")
    rc, out, err = train_cli(config, "--resume", *common)
    assert rc == 0, err
    assert not [q.name for q in (run / "checkpoints").iterdir() if q.name.startswith(".")]
    assert_same_weights(
        weights(latest_checkpoint(run / "checkpoints")), _reference(tmp_path, config, *common[1:])
    )
    ref_rows = _train_rows(tmp_path / f"ref_{abs(hash(tuple(common[1:])))}")
    assert (
        _train_rows(run) == ref_rows
    )  # every step logged once, with the uninterrupted run's losses


@pytest.mark.slow
def test_kill_mid_resave_keeps_latest_loadable_and_recovers(tmp_path):
    config = run_config(tmp_path)
    run = tmp_path / "run"
    common = [f"out_dir={run}", "max_steps=6", "ckpt_interval=3", "keep_last=1"]
    rc, _, err = train_cli(config, *common)
    assert rc == 0, err
    expected = _reference(tmp_path, config, *common[1:])
    assert_same_weights(weights(run / "checkpoints" / "step_00000006"), expected)
    # resuming at max_steps re-saves step 6: killed after the old folder was moved aside
    _drive("mid_resave", 6, config, "--resume", *common)
    assert not (run / "checkpoints" / "step_00000006").exists()
    p = _assert_latest_loadable(
        run / "checkpoints"
    )  # the folder moved aside is what latest resolves to
    assert_same_weights(weights(p), expected)
    rc, out, err = train_cli(config, "--resume", *common)
    assert rc == 0, err
    assert "resumed at step 6" in out
    assert sorted(q.name for q in (run / "checkpoints").iterdir()) == ["latest", "step_00000006"]
    assert_same_weights(weights(run / "checkpoints" / "step_00000006"), expected)


@pytest.mark.slow
def test_random_kills_then_resume_is_bit_exact(tmp_path):
    """A real ``python -m lmstack train`` killed with SIGKILL at random moments, restarted each time
    (``--resume`` once a checkpoint exists), ends with the uninterrupted run's weights and losses."""
    config = run_config(tmp_path)
    run = tmp_path / "run"
    common = [f"out_dir={run}", "max_steps=60", "ckpt_interval=1", "keep_last=2"]
    rng = random.Random(13)
    kills, killed_at = 0, []
    for _attempt in range(12):
        ck = run / "checkpoints"
        has_ckpt = ck.is_dir() and latest_checkpoint(ck) is not None
        extra = ["--resume"] if has_ckpt else (["--overwrite"] if run.exists() else [])
        start_mtime = _logged(run)
        proc = spawn(
            [
                sys.executable,
                "-m",
                "lmstack",
                "train",
                "--config",
                str(config),
                "--no-progress",
                "--threads",
                "1",
                *common,
                *extra,
            ]
        )
        if kills < 4:  # once this process has logged a step, kill it within the next 0.4 s
            deadline = time.time() + 60
            while _logged(run) <= start_mtime and proc.poll() is None and time.time() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.4))
            proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        if proc.returncode == -signal.SIGKILL:
            kills += 1
            killed_at.append(max([s for s, _ in _train_rows(run)], default=0))
            if ck.is_dir() and latest_checkpoint(ck) is not None:
                _assert_latest_loadable(ck)
            continue
        assert proc.returncode == 0, err.decode()
        break
    else:
        raise AssertionError("the run never finished")
    print("killed after steps", killed_at)
    assert kills >= 2 and any(0 < s < 60 for s in killed_at), killed_at  # killed mid-training
    assert_same_weights(
        weights(latest_checkpoint(run / "checkpoints")), _reference(tmp_path, config, *common[1:])
    )
    assert _train_rows(run) == _train_rows(tmp_path / f"ref_{abs(hash(tuple(common[1:])))}")


# ---- the two data-loss sequences of the issue -------------------------------------------------


def test_rerun_with_fewer_steps_never_loses_the_checkpoint_it_wrote(tmp_path):
    config = run_config(tmp_path)
    run = tmp_path / "R"
    rc, _, err = train_cli(
        config, f"out_dir={run}", "max_steps=10", "ckpt_interval=5", "keep_last=1"
    )
    assert rc == 0, err
    before = snapshot(run)
    # the same command with max_steps=6: a fresh run into a folder holding a run is refused
    rc, _, err = train_cli(
        config, f"out_dir={run}", "max_steps=6", "ckpt_interval=5", "keep_last=1"
    )
    assert rc == 2 and "already holds a run" in err and "--overwrite" in err
    rc, _, err = train_cli(
        config, "--resume", f"out_dir={run}", "max_steps=6", "ckpt_interval=5", "keep_last=1"
    )
    assert rc == 2 and "past max_steps=6" in err
    assert snapshot(run) == before
    # --overwrite: the 6-step run replaces it; the checkpoint it prints exists and holds its weights
    rc, out, err = train_cli(
        config, "--overwrite", f"out_dir={run}", "max_steps=6", "ckpt_interval=5", "keep_last=1"
    )
    assert rc == 0, err
    assert f"checkpoint  {run / 'checkpoints' / 'step_00000006'}" in out
    expected = _reference(tmp_path, config, "max_steps=6", "ckpt_interval=5", "keep_last=1")
    assert_same_weights(weights(run / "checkpoints" / "step_00000006"), expected)
    assert [s for s, _ in _train_rows(run)] == list(range(1, 7))
    rc, out, err = train_cli(config, "--resume", f"out_dir={run}", "max_steps=6")
    assert rc == 0 and "resumed at step 6" in out, err
    assert_same_weights(weights(latest_checkpoint(run / "checkpoints")), expected)


def test_rollback_then_smaller_keep_last_keeps_the_new_checkpoint(tmp_path):
    from lmstack.train import TrainConfig, Trainer

    config = run_config(tmp_path)
    run = tmp_path / "R"
    rc, _, err = train_cli(
        config, f"out_dir={run}", "max_steps=10", "ckpt_interval=5", "keep_last=2"
    )
    assert rc == 0, err
    rc, out, err = train_cli(
        config,
        "--resume",
        str(run / "checkpoints" / "step_00000005"),
        f"out_dir={run}",
        "max_steps=8",
        "ckpt_interval=5",
        "keep_last=1",
    )
    assert rc == 0 and "resumed at step 5" in out, err
    ck = run / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_00000008"
    assert _assert_latest_loadable(ck).name == "step_00000008"
    assert [p.name for p in ckpt.step_dirs(ck)] == [
        "step_00000008"
    ]  # keep_last=1: the abandoned step 10 went
    # independent expectation: 5 steps of the 10-step schedule, then the end moved to 8, in one process
    with one_thread():
        t = Trainer(
            TrainConfig.load(config, [f"out_dir={tmp_path / 'straight'}", "max_steps=10"]),
            progress=False,
        )
        for _ in range(5):
            t.train_step()
        t.set_max_steps(8)
        for _ in range(3):
            t.train_step()
    assert_same_weights(
        weights(ck / "step_00000008"), {k: v.detach() for k, v in t.raw_model.state_dict().items()}
    )
    assert [s for s, _ in _train_rows(run)] == list(
        range(1, 9)
    )  # steps 6-10 of the abandoned run dropped
    rc, out, err = train_cli(config, "--resume", f"out_dir={run}", "max_steps=8")
    assert rc == 0 and "resumed at step 8" in out, err


# ---- latest, leftovers, disk full -----------------------------------------------------------------


def test_latest_naming_a_missing_checkpoint_is_an_error(tmp_path):
    import shutil

    config = run_config(tmp_path)
    run = tmp_path / "R"
    rc, _, err = train_cli(
        config, f"out_dir={run}", "max_steps=4", "ckpt_interval=2", "keep_last=2"
    )
    assert rc == 0, err
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    rc, out, err = train_cli(config, "--resume", f"out_dir={run}", "max_steps=4")
    assert rc == 2, out
    assert f"latest names {run / 'checkpoints' / 'step_00000004'}, which is missing" in err
    assert "step_00000002" in err  # what is there instead


def test_leftovers_of_crashed_saves_are_removed_at_start(tmp_path):
    config = run_config(tmp_path)
    run = tmp_path / "R"
    rc, _, err = train_cli(
        config, f"out_dir={run}", "max_steps=4", "ckpt_interval=2", "keep_last=2"
    )
    assert rc == 0, err
    ck = run / "checkpoints"
    for name in (
        ".tmp_step_00000006_123",
        ".staging_step_00000006.shards",
        ".old_step_00000004_77",
        ".pruned_step_00000001_5",
    ):
        (ck / name).mkdir()
        (ck / name / "junk").write_bytes(b"x")
    rc, out, err = train_cli(config, "--resume", f"out_dir={run}", "max_steps=6", "ckpt_interval=2")
    assert rc == 0, err
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000004", "step_00000006"]


@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_disk_full_during_a_checkpoint_is_a_clear_error_and_keeps_the_previous(tmp_path, error):
    from safetensors import SafetensorError

    from lmstack.train import TrainConfig, Trainer

    config = run_config(tmp_path)
    run = tmp_path / "R"
    real = ckpt.save_file

    def full(tensors, path, *a, **kw):
        if ".tmp_step_00000004" in str(path):
            Path(path).write_bytes(b"partial")
            if error == "oserror":
                raise OSError(errno.ENOSPC, "No space left on device")
            raise SafetensorError(
                "Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                'message: "No space left on device" })'
            )
        return real(tensors, path, *a, **kw)

    with mock.patch.object(ckpt, "save_file", full):
        rc, out, err = train_cli(config, f"out_dir={run}", "max_steps=6", "ckpt_interval=2")
    assert rc == 2, out
    assert "No space left on device" in err and "Traceback" not in err
    assert f"the previous checkpoint {run / 'checkpoints' / 'step_00000002'} is intact" in err
    ck = run / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000002"]
    with one_thread():
        t = Trainer(
            TrainConfig.load(config, [f"out_dir={tmp_path / 'straight'}", "max_steps=6"]),
            progress=False,
        )
        t.train_step()
        t.train_step()
    assert_same_weights(
        weights(_assert_latest_loadable(ck)),
        {k: v.detach() for k, v in t.raw_model.state_dict().items()},
    )
