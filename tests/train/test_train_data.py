"""Memmap data: get_batch shapes/offset/coverage/devices, sequential eval batches, packing, token budgets."""

import numpy as np
import pytest
import torch

from lmstack.tokenizer import open_tokens
from lmstack.train import (
    get_batch,
    pack_documents,
    pad_batch,
    sequential_batches,
    split_documents,
    token_budget_batches,
)
from lmstack.train.data import document_layout


def test_open_tokens_reads_sidecar_and_rejects_bad_files(tmp_path, token_file):
    data = open_tokens(token_file)
    assert isinstance(data, np.memmap) and data.dtype == np.uint16 and len(data) == 20000
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_tokens(tmp_path / "nope.bin")
    (tmp_path / "raw.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="no sidecar"):
        open_tokens(tmp_path / "raw.bin")
    with pytest.raises(ValueError, match="not a multiple"):
        open_tokens(tmp_path / "raw.bin", dtype="uint16")


def test_get_batch_shapes_and_offset():
    data = np.arange(1000, dtype=np.uint16)
    g = torch.Generator().manual_seed(0)
    b = get_batch(data, 8, 32, "cpu", g)
    assert b.x.shape == b.y.shape == (8, 32) and b.x.dtype == torch.int64
    assert torch.equal(b.y, b.x + 1)  # y is x shifted by one token
    assert torch.equal(b.x[:, 1:], b.x[:, :-1] + 1)  # contiguous windows
    assert b.positions is None and b.document_ids is None


def test_get_batch_covers_every_valid_start_uniformly():
    n, S = 40, 8  # valid starts 0 .. n-S-1 = 31 (32 of them)
    data = np.arange(n, dtype=np.uint16)
    g = torch.Generator().manual_seed(1)
    counts = np.zeros(n, dtype=int)
    draws = 200
    for _ in range(draws):
        b = get_batch(data, 64, S, "cpu", g)
        np.add.at(counts, b.x[:, 0].numpy(), 1)
    assert (
        counts[: n - S].min() > 0 and counts[n - S :].sum() == 0
    )  # every valid start, nothing beyond
    expected = draws * 64 / (n - S)
    chi2 = ((counts[: n - S] - expected) ** 2 / expected).sum()
    assert chi2 < 70  # 31 degrees of freedom: p ≈ 1e-4 at 70


def test_get_batch_is_deterministic_for_a_seed():
    data = np.arange(500, dtype=np.uint16)
    a = get_batch(data, 4, 16, "cpu", torch.Generator().manual_seed(7))
    b = get_batch(data, 4, 16, "cpu", torch.Generator().manual_seed(7))
    assert torch.equal(a.x, b.x)


def test_get_batch_invalid_device_and_sizes():
    data = np.arange(100, dtype=np.uint16)
    with pytest.raises(ValueError, match="device='gpu7'"):
        get_batch(data, 2, 8, "gpu7")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            get_batch(data, 2, 8, "cuda")
    with pytest.raises(ValueError, match="needs at least 101"):
        get_batch(data, 2, 100)
    with pytest.raises(ValueError, match="batch_size=0"):
        get_batch(data, 0, 8)


def test_sequential_batches_target_every_token_once():
    data = np.arange(103, dtype=np.uint16)
    batches = list(sequential_batches(data, 3, 10, "cpu"))
    ys = torch.cat([b.y.reshape(-1) for b in batches])
    assert ys.tolist() == list(range(1, 101))  # starts 0,10,...,90; targets 1..100 once each
    assert [b.x.shape[0] for b in batches] == [3, 3, 3, 1]
    assert len(list(sequential_batches(data, 3, 10, "cpu", max_batches=2))) == 2


def test_document_layout_and_packed_targets():
    sep = 0
    w = np.array([[5, 6, 0, 7, 8, 9, 0, 4]])
    doc, pos = document_layout(w, sep)
    assert doc.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    b = get_batch(w[0], 1, 7, "cpu", torch.Generator().manual_seed(0), sep_id=sep)
    assert b.x.tolist() == [[5, 6, 0, 7, 8, 9, 0]]
    # the separator's target (7, first token of the next document) crosses a boundary: ignored
    assert b.y.tolist() == [[6, 0, -100, 8, 9, 0, -100]]
    assert b.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3]]


def test_packing_mask_equals_running_documents_separately():
    """Logits of a packed row == logits of each document run alone (attention never crosses)."""
    from lmstack.model import ModelConfig
    from lmstack.model.transformer import Transformer

    cfg = ModelConfig(
        vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64
    )
    model = Transformer(cfg, seed=0).double().eval()
    docs = [[3, 4, 5, 0], [6, 7, 8, 9, 10, 0], [11, 12, 0]]
    packed = pack_documents(docs, seq_len=15, sep_id=0)
    assert packed.x.shape == (1, 15)
    with torch.no_grad():
        out = model(packed.x, positions=packed.positions, document_ids=packed.document_ids)
        start = 0
        for d in docs:
            alone = model(torch.tensor([d]))
            torch.testing.assert_close(out[0, start : start + len(d)], alone[0])
            start += len(d)
    # no target crosses a document or falls on padding
    assert packed.y[0].tolist() == [4, 5, 0, -100, 7, 8, 9, 10, 0, -100, 12, 0, -100, -100, -100]


def test_pack_documents_splits_long_documents_and_fills_rows():
    docs = [list(range(1, 20)), [30, 31], [40, 41, 42]]
    b = pack_documents(docs, seq_len=9, sep_id=0)
    assert b.x.shape[1] == 9
    targets = sorted(t for t in b.y.reshape(-1).tolist() if t != -100)
    # every token after a document's first is a target exactly once (sep 0 closes each of 3 docs)
    assert targets == sorted([0, 0, 0] + list(range(2, 20)) + [31] + [41, 42])
    assert split_documents(np.array([1, 2, 0, 3, 0, 4]), 0)[1].tolist() == [3, 0]


def test_token_budget_batches_respect_budget_and_cover_all():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, size=200).tolist()
    batches = token_budget_batches(lengths, max_tokens=128, seed=3)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(200))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 128
    with pytest.raises(ValueError, match="sequence 0 has 10 tokens > max_tokens=5"):
        token_budget_batches([10], 5)


def test_pad_batch_ignores_padding():
    b = pad_batch([[1, 2, 3], [4, 5]], pad_id=0)
    assert b.x.tolist() == [[1, 2], [4, 5]]
    assert b.y.tolist() == [[2, 3], [5, -100]]
