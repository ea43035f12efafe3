"""Launch: ``torchrun --nproc_per_node=2 -m lmstack.train --config run.json parallel=ddp`` on gloo
(torchrun --standalone: its store on a port it binds itself) trains through the trainer's ``parallelize`` seam: the process group is
initialised from torchrun's environment, the model is wrapped in lmstack's DataParallel, both
ranks step together and rank 0 writes the metrics. (Exact agreement with single-process
training is shown by the spawn-based tests; the trainer samples a different batch per rank.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


@pytest.mark.slow
def test_torchrun_ddp_through_the_trainer(tmp_path):
    rng = np.random.default_rng(0)
    ids = np.tile(np.arange(1, 33), 200)[:6000]
    ids = np.where(rng.random(ids.shape) < 0.1, rng.integers(1, 64, size=ids.shape), ids).astype(
        np.uint16
    )
    data = tmp_path / "tokens.bin"
    ids.tofile(data)
    (tmp_path / "tokens.bin.json").write_text(
        json.dumps({"n_tokens": len(ids), "dtype": "uint16", "vocab_size": 64})
    )
    cfg = {
        "model": {
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "d_ff": 64,
            "vocab_size": 64,
            "max_seq_len": 64,
        },
        "train_data": str(data),
        "batch_size": 2,
        "seq_len": 16,
        "max_steps": 3,
        "warmup_steps": 0,
        "eval_interval": 0,
        "eval_batches": 1,
        "log_interval": 1,
        "out_dir": str(tmp_path / "run"),
        "device": "cpu",
        "precision": "fp32",
        "parallel": "ddp",
    }
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    torchrun = Path(sys.executable).with_name("torchrun")
    # --standalone: the rendezvous store binds port 0 itself (no port picked in advance, no race)
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "lmstack.train",
        "--config",
        str(tmp_path / "run.json"),
        "--no-progress",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    train = [row for row in rows if row["kind"] == "train"]
    assert [row["step"] for row in train] == [1, 2, 3]
    assert all(np.isfinite(row["loss"]) for row in train)
    # tokens per step count both ranks: B·S·world
    assert train[0]["tokens"] == 2 * 16 * 2
