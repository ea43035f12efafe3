"""Checkpoints: exact round trip, resume == uninterrupted run, atomic saves, keep_last."""

from unittest import mock

import pytest
import torch
from conftest import tiny_config

from lmstack.train import Trainer, latest_checkpoint, load_checkpoint, save_checkpoint
from lmstack.train import checkpoint as ckpt
from lmstack.train.checkpoint import CheckpointError, step_dirs


def _losses(trainer, steps):
    return [trainer.train_step()["loss"] for _ in range(steps)]


def test_round_trip_restores_exact_state(token_file, tmp_path):
    t = Trainer(tiny_config(token_file, tmp_path / "a"), progress=False)
    _losses(t, 3)
    path = t.save_checkpoint()
    u = Trainer(
        tiny_config(token_file, tmp_path / "b", seed=123), progress=False
    )  # different init and sampler
    u.resume(path)
    assert u.step == 3 and u.tokens_seen == t.tokens_seen
    for (n, a), (_, b) in zip(t.raw_model.state_dict().items(), u.raw_model.state_dict().items()):
        assert torch.equal(a, b), n
    sa, sb = t.optimizer.state_dict(), u.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(
                torch.as_tensor(sa["state"][i][k]), torch.as_tensor(sb["state"][i][k])
            )
    assert torch.equal(t.data_generator.get_state(), u.data_generator.get_state())
    assert _losses(t, 2) == _losses(u, 2)


def test_kill_and_resume_gives_identical_losses(token_file, tmp_path):
    straight = Trainer(tiny_config(token_file, tmp_path / "straight", max_steps=8), progress=False)
    expected = _losses(straight, 8)

    cfg = tiny_config(token_file, tmp_path / "killed", max_steps=8, ckpt_interval=2)
    first = Trainer(cfg, progress=False)

    def kill(trainer, metrics):
        if trainer.step == 5:  # dies after step 5; the last checkpoint is step 4
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        first.fit(callback=kill)
    assert latest_checkpoint(tmp_path / "killed" / "checkpoints").name == "step_00000004"
    second = Trainer(cfg, progress=False)
    assert second.resume() == 4
    assert _losses(second, 4) == expected[4:]


def test_interrupted_save_leaves_previous_checkpoint_loadable(token_file, tmp_path):
    t = Trainer(tiny_config(token_file, tmp_path), progress=False)
    _losses(t, 2)
    good = t.save_checkpoint()
    good_state = {k: v.clone() for k, v in t.raw_model.state_dict().items()}
    _losses(t, 1)
    real = ckpt._save_tensors
    calls = []

    def crash_on_optimizer(tensors, path):
        calls.append(path.name)
        if path.name == "optimizer.safetensors":
            path.write_bytes(b"partial")
            raise OSError("disk full (simulated crash mid-save)")
        real(tensors, path)

    with (
        mock.patch.object(ckpt, "_save_tensors", crash_on_optimizer),
        pytest.raises(OSError, match="disk full"),
    ):
        t.save_checkpoint()
    assert calls[:2] == ["model.safetensors", "optimizer.safetensors"]
    d = tmp_path / "checkpoints"
    assert latest_checkpoint(d) == good
    assert [p.name for p in step_dirs(d)] == ["step_00000002"]
    fresh = Trainer(tiny_config(token_file, tmp_path / "fresh"), progress=False)
    load_checkpoint(good, fresh.raw_model, fresh.optimizer)
    for k, v in fresh.raw_model.state_dict().items():
        assert torch.equal(v, good_state[k])
    # the next good save cleans the leftover temporary directory
    t.save_checkpoint()
    assert not list(d.glob(".tmp_*"))


def test_keep_last_prunes_old_checkpoints(tmp_path):
    model = torch.nn.Linear(2, 2)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, keep_last=2)
    assert [p.name for p in step_dirs(tmp_path)] == ["step_00000004", "step_00000005"]
    assert latest_checkpoint(tmp_path).name == "step_00000005"


def test_bad_checkpoints_raise_clear_errors(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="no state.json"):
        load_checkpoint(tmp_path, model)
    p = save_checkpoint(tmp_path, 1, model)
    with pytest.raises(CheckpointError, match="has shape .* the model expects"):
        load_checkpoint(p, torch.nn.Linear(2, 3))
    (p / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(p, model)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_matches_uninterrupted(token_file, tmp_path):
    """A real process killed with SIGKILL while training; the resumed run's losses equal a straight run's."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from lmstack.train.plot import read_metrics

    cfg = tiny_config(token_file, tmp_path / "killed", max_steps=400, ckpt_interval=3, keep_last=2)
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(json.dumps(cfg.to_dict()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmstack.train", "--config", str(cfg_path), "--no-progress"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    ckdir = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 120
    try:
        while time.time() < deadline and not (
            latest_checkpoint(ckdir) and latest_checkpoint(ckdir).name >= "step_00000006"
        ):
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    resumed = Trainer(cfg, progress=False)
    start = resumed.resume()
    assert start >= 6
    resumed.config.stop_after = 4
    resumed.fit()
    got = {
        r["step"]: r["loss"]
        for r in read_metrics(tmp_path / "killed" / "metrics.jsonl")
        if r["kind"] == "train"
    }

    straight = Trainer(
        tiny_config(token_file, tmp_path / "straight", max_steps=400), progress=False
    )
    expected = [straight.train_step()["loss"] for _ in range(start + 4)]
    assert [got[s] for s in range(start + 1, start + 5)] == expected[start:]
