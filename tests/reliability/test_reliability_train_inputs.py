"""Issue 13, training inputs: token ids outside the vocabulary and sidecars that disagree with the
file are refused at start with the value and position; TrainConfig accepts only real booleans and
names the field; --resume does not swallow a key=value; a bad --sample tokenizer fails before
training; --threads and its default (affinity, cgroup quota); the distributed timeout."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from reliability_train_helpers import cli, corpus_ids, run_config, train_cli, write_tokens

from lmstack.tokenizer import check_token_ids
from lmstack.train import TrainConfig, Trainer
from lmstack.train.config import TrainConfigError


def _config(tmp: Path, **kw) -> TrainConfig:
    path = run_config(tmp, max_steps=2)
    d = json.loads(path.read_text())
    d.update(out_dir=str(tmp / "run"), **kw)
    return TrainConfig(**d)


# ---- token files ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,bad,pos",
    [
        ("uint16", 64, 4321),
        ("uint16", 65535, 0),
        ("int32", -3, 777),
        ("int64", 2**40, 5999),
        ("uint32", 70000, 3000),
    ],
)
def test_token_id_outside_the_vocabulary_is_refused_at_start(tmp_path, dtype, bad, pos):
    ids = corpus_ids().astype(dtype)
    ids[pos] = bad
    data = write_tokens(tmp_path / "bad.bin", ids, dtype=dtype)
    with pytest.raises(
        ValueError,
        match=rf"token id {bad} at position {pos} is outside the model's vocabulary "
        r"0\.\.63 \(vocab_size=64\)",
    ):
        Trainer(_config(tmp_path, train_data=str(data)), progress=False)
    assert not (tmp_path / "run").exists()  # refused before writing anything


def test_bad_id_in_val_data_is_refused_too(tmp_path):
    ids = corpus_ids()
    ids[100] = 99
    val = write_tokens(tmp_path / "val.bin", ids)
    with pytest.raises(ValueError, match=r"val_data .*val\.bin: token id 99 at position 100"):
        Trainer(_config(tmp_path, val_data=str(val)), progress=False)


def test_scan_reports_the_first_bad_id_across_chunks():
    ids = np.zeros(100, dtype=np.int64)
    ids[[23, 57]] = [64, -1]
    with pytest.raises(ValueError, match="token id 64 at position 23"):
        check_token_ids(ids, 64, chunk=7)
    ids[23] = 0
    with pytest.raises(ValueError, match="token id -1 at position 57"):
        check_token_ids(ids, 64, chunk=7)
    ids[57] = 63
    check_token_ids(ids, 64, chunk=7)  # every id in range: no error


def test_memmapped_scan_of_a_file(tmp_path):
    ids = corpus_ids(50_000)
    ids[49_999] = 64
    data = write_tokens(tmp_path / "t.bin", ids)
    mm = np.memmap(data, dtype=np.uint16, mode="r")
    with pytest.raises(ValueError, match="token id 64 at position 49999"):
        check_token_ids(mm, 64, chunk=4096)


@pytest.mark.parametrize("written,claimed", [("uint16", "uint32"), ("uint32", "uint16")])
def test_sidecar_dtype_disagreeing_with_the_file_is_refused(tmp_path, written, claimed):
    ids = corpus_ids(4000).astype(written)
    data = tmp_path / "t.bin"
    ids.tofile(data)
    Path(str(data) + ".json").write_text(
        json.dumps({"n_tokens": 4000, "dtype": claimed, "vocab_size": 64})
    )
    with pytest.raises(
        ValueError,
        match=rf"the sidecar says 4000 tokens of {claimed} \(\d+ bytes\) but the file "
        rf"has {ids.nbytes} bytes",
    ):
        Trainer(_config(tmp_path, train_data=str(data)), progress=False)


def test_cli_bad_token_file_exits_2_with_the_position(tmp_path):
    ids = corpus_ids()
    ids[4321] = 64
    write_tokens(tmp_path / "bad.bin", ids)
    config = run_config(tmp_path, max_steps=2)
    rc, _, err = train_cli(
        config, f"out_dir={tmp_path / 'run'}", f"train_data={tmp_path / 'bad.bin'}"
    )
    assert rc == 2 and "token id 64 at position 4321" in err


# ---- TrainConfig --------------------------------------------------------------------------------

BOOLS = ["compile", "fused_loss", "packing", "activation_checkpointing"]


@pytest.mark.parametrize("field", BOOLS)
@pytest.mark.parametrize("value", ["false", "no", "true", 0, 1, None, 0.0])
def test_boolean_fields_accept_only_booleans(tmp_path, field, value):
    with pytest.raises(TrainConfigError, match=rf"^{field}={value!r} must be true or false"):
        _config(tmp_path, **{field: value}, sep_id=0)


@pytest.mark.parametrize("field", BOOLS)
def test_boolean_fields_accept_real_booleans(tmp_path, field):
    for v in (True, False):
        assert getattr(_config(tmp_path, **{field: v}, sep_id=0), field) is v


def test_toml_string_false_is_refused_through_the_cli(tmp_path):
    config = run_config(tmp_path, max_steps=2)
    toml = tmp_path / "run.toml"
    d = json.loads(config.read_text())
    toml.write_text(f'train_data = "{d["train_data"]}"\ncompile = "false"\n[model]\nd_model = 32\n')
    rc, _, err = cli(
        "train", "--config", toml, f"out_dir={tmp_path / 'run'}", "--no-progress", "--threads", "1"
    )
    assert rc == 2 and "compile='false' must be true or false" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "field,value",
    [
        ("lr", "3e-4"),
        ("batch_size", "8"),
        ("max_steps", "10"),
        ("grad_clip", "1.0"),
        ("seed", "0"),
        ("keep_last", "2"),
        ("dist_timeout_s", "60"),
        ("sep_id", "0"),
        ("qk_norm", "no"),
        ("train_data", 5),
        ("tokenizer", 3),
    ],
)
def test_fields_given_as_the_wrong_type_name_the_field(tmp_path, field, value):
    with pytest.raises(TrainConfigError, match=rf"^{field}={value!r} must be"):
        _config(tmp_path, **{field: value})


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"sep_id": 64}, "sep_id=64 is not a token id of the model (vocab_size=64: ids 0..63)"),
        ({"sep_id": -1}, "sep_id=-1 must be a non-negative integer"),
        (
            {"model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "eos_token_id": 64}},
            "model: eos_token_id=64 is not a token id of vocab_size=64",
        ),
    ],
)
def test_ids_checked_against_the_vocabulary(tmp_path, overrides, message):
    with pytest.raises(TrainConfigError) as e:
        Trainer(_config(tmp_path, **overrides), progress=False)
    assert message in str(e.value)


def test_dist_timeout_must_be_positive(tmp_path):
    for bad in (0, -5, float("inf")):
        with pytest.raises(TrainConfigError, match="dist_timeout_s="):
            _config(tmp_path, dist_timeout_s=bad)
    assert _config(tmp_path, dist_timeout_s=30).dist_timeout_s == 30


# ---- CLI parsing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["after", "before", "between"])
def test_resume_does_not_swallow_a_following_override(tmp_path, order):
    config = run_config(tmp_path)
    run = tmp_path / "run"
    rc, _, err = train_cli(config, f"out_dir={run}", "max_steps=4", "ckpt_interval=2")
    assert rc == 0, err
    args = {
        "after": ["--resume", "max_steps=6", f"out_dir={run}"],
        "before": [f"out_dir={run}", "--resume", "max_steps=6"],
        "between": [f"out_dir={run}", "--resume", "max_steps=6", "log_interval=1"],
    }[order]
    rc, out, err = train_cli(config, *args)
    assert rc == 0, err
    assert "resumed at step 4" in out and "step 6:" in out
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000006"


def test_resume_with_a_checkpoint_path_still_works(tmp_path):
    config = run_config(tmp_path)
    run = tmp_path / "run"
    assert train_cli(config, f"out_dir={run}", "max_steps=4", "ckpt_interval=2")[0] == 0
    rc, out, err = train_cli(
        config,
        "--resume",
        str(run / "checkpoints" / "step_00000002"),
        f"out_dir={run}",
        "max_steps=4",
    )
    assert rc == 0 and "resumed at step 2" in out, err


@pytest.mark.parametrize("tokenizer", [None, "missing.json", "corrupt"])
def test_bad_sample_tokenizer_fails_before_training(tmp_path, tokenizer):
    config = run_config(tmp_path, max_steps=3)
    args = [f"out_dir={tmp_path / 'run'}", "--sample", "def "]
    if tokenizer == "corrupt":
        (tmp_path / "corrupt.json").write_text("[1, 2")
        args.append(f"tokenizer={tmp_path / 'corrupt.json'}")
    elif tokenizer:
        args.append(f"tokenizer={tmp_path / tokenizer}")
    rc, out, err = train_cli(config, *args)
    assert rc == 2, out
    assert err.startswith("lmstack: error: ")
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


# ---- threads ----------------------------------------------------------------------------------------


def test_cgroup_quota_v2_nested_and_v1(tmp_path):
    from lmstack.threads import cgroup_cpu_quota

    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "a" / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs on the parent
    (root / "a" / "b" / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert cgroup_cpu_quota(root, proc) == 1.5
    (root / "a" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(root, proc) is None
    (root / "cpu").mkdir()
    (root / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(root, proc) == 3.0
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(root, proc) is None


def test_available_cpus_takes_affinity_and_quota(monkeypatch):
    import os

    from lmstack import threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: None)
    assert threads.available_cpus() == 4
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: 2.5)
    assert threads.available_cpus() == 2
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: 0.2)
    assert threads.available_cpus() == 1


def test_threads_flag(tmp_path, monkeypatch):
    from lmstack.threads import available_cpus, set_threads

    old = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        assert set_threads(None) == available_cpus() == torch.get_num_threads()
        monkeypatch.setenv(
            "OMP_NUM_THREADS", "1"
        )  # torchrun's setting for several ranks per machine wins
        assert set_threads(None) == 1 == torch.get_num_threads()
        assert set_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(old)
    config = run_config(tmp_path, max_steps=2)
    for bad in ("0", "-2"):
        rc, _, err = cli(
            "train", "--config", config, f"out_dir={tmp_path / 'run'}", "--threads", bad
        )
        assert rc == 2 and f"--threads={int(bad)} must be an integer >= 1" in err


# ---- distributed: a stalled rank ----------------------------------------------------------------------


@pytest.mark.slow
def test_stalled_rank_is_detected_after_the_timeout():
    """Rank 1 stays alive but never joins the barrier: rank 0 raises after ~timeout_s, not 600 s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    driver = str(Path(__file__).with_name("reliability_stall_driver.py"))
    procs = [
        subprocess.Popen(
            [sys.executable, driver, str(r), port, "3", "30"], stdout=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    out0, _ = procs[0].communicate(timeout=60)
    procs[1].kill()
    procs[1].wait()
    assert "Timed out" in out0, out0
    waited = float(out0.split(" after ")[1].split("s")[0])
    assert 2.5 <= waited < 10, out0
