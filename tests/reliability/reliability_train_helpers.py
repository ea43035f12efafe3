"""Helpers for the training/CLI reliability tests: tiny token files and configs, lmstack's CLI run
in-process or as a real subprocess, and the final weights of a run."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

LMSTACK = [sys.executable, "-m", "lmstack"]


def write_tokens(
    path: Path, ids, vocab_size: int = 64, dtype: str = "uint16", n_tokens: int | None = None
) -> Path:
    """A token file and its sidecar, as ``lmstack tokenizer encode`` writes them."""
    arr = np.asarray(ids, dtype=dtype)
    arr.tofile(path)
    meta = {
        "n_tokens": len(arr) if n_tokens is None else n_tokens,
        "dtype": dtype,
        "vocab_size": vocab_size,
    }
    Path(str(path) + ".json").write_text(json.dumps(meta))
    return path


def corpus_ids(n: int = 6000) -> np.ndarray:
    """Ids over V=64 with learnable structure (a noisy repeating pattern)."""
    rng = np.random.default_rng(0)
    base = np.tile(np.arange(1, 33), n // 32 + 1)[:n]
    return np.where(rng.random(n) < 0.1, rng.integers(1, 64, size=n), base)


def run_config(tmp: Path, **kw) -> Path:
    """A tiny run's config file (L=2, D=32, V=64; B=4, S=16; fp32 on the CPU) beside a token file."""
    tokens = tmp / "tokens.bin"
    if not tokens.exists():
        write_tokens(tokens, corpus_ids())
    cfg = dict(
        model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64),
        train_data=str(tokens),
        batch_size=4,
        seq_len=16,
        warmup_steps=2,
        lr=1e-2,
        min_lr=1e-3,
        eval_interval=0,
        eval_batches=2,
        log_interval=1,
        device="cpu",
        precision="fp32",
        keep_last=2,
    )
    cfg.update(kw)
    path = tmp / "run.json"
    path.write_text(json.dumps(cfg))
    return path


def cli(*args: str) -> tuple[int, str, str]:
    """``lmstack ARGS`` in this process: (exit code, stdout, stderr)."""
    from lmstack.cli import main

    out, err = io.StringIO(), io.StringIO()
    with one_thread(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse errors
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


@contextlib.contextmanager
def one_thread():
    """Torch on one thread inside (as the subprocesses run: bit-equal results), restored after
    (``lmstack`` main sets the thread count from --threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_cli(config: Path, *args: str) -> tuple[int, str, str]:
    return cli("train", "--config", config, "--no-progress", "--threads", "1", *args)


def spawn(args: list[str], **kw) -> subprocess.Popen:
    """A real ``python -m lmstack ...`` (or driver) process, one thread, output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(checkpoint) / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file()
    }
