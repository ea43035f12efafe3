"""Shared fixtures for the training tests: small token files written like `lmstack tokenizer encode` does."""

import json

import numpy as np
import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs with one intra-op thread (the root conftest's ``one_thread``)."""


def write_tokens(path, ids, vocab_size):
    arr = np.asarray(ids, dtype=np.uint16)
    arr.tofile(path)
    meta = {"n_tokens": len(arr), "dtype": "uint16", "vocab_size": vocab_size}
    (path.parent / (path.name + ".json")).write_text(json.dumps(meta))
    return path


@pytest.fixture
def token_file(tmp_path):
    """A 20k-token file over V=64 with learnable structure (a noisy repeating pattern)."""
    rng = np.random.default_rng(0)
    base = np.tile(np.arange(1, 33), 700)[:20000]
    noise = rng.integers(1, 64, size=base.shape)
    ids = np.where(rng.random(base.shape) < 0.1, noise, base)
    ids[::97] = 0  # document separators
    return write_tokens(tmp_path / "tokens.bin", ids, 64)


def tiny_config(token_file, out_dir, **kw):
    from lmstack.train import TrainConfig

    d = dict(
        model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64),
        train_data=str(token_file),
        batch_size=4,
        seq_len=16,
        max_steps=10,
        warmup_steps=2,
        lr=1e-2,
        min_lr=1e-3,
        eval_interval=0,
        eval_batches=2,
        log_interval=1,
        out_dir=str(out_dir),
        device="cpu",
        precision="fp32",
        keep_last=3,
    )
    d.update(kw)
    return TrainConfig(**d)
