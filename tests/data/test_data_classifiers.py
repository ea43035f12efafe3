"""Classifiers: a fastText quality classifier trained on user examples and the generated NSFW/toxic models beat
chance on held-out data; the CCNet perplexity scorer equals torch's cross-entropy; thresholds and percentiles."""

import math
import random

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fasttext")

from lmstack.data.classifiers import (
    ClassifierFilter,
    FastTextClassifier,
    PerplexityFilter,
    PerplexityScorer,
    builtin_classifier,
    generated_examples,
    precision_recall,
    train_fasttext,
)
from lmstack.data.corpus import prose
from lmstack.data.document import Document
from lmstack.data.step import StepStats

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny forwards: threads only contend


def spam(rng: random.Random) -> str:
    kw = rng.sample(
        ["cheap", "watches", "best", "price", "buy", "now", "replica", "online", "sale", "deal"], 3
    )
    return " ".join(kw * rng.randint(3, 8)) + " click here"


def test_quality_classifier_beats_chance_on_held_out(tmp_path):
    rng = random.Random(0)
    good = [" ".join(prose(rng, (1, 2))) for _ in range(300)]
    bad = [spam(rng) for _ in range(300)]
    train_fasttext(good[:200], bad[:200], tmp_path / "q.bin", epoch=10)
    clf = FastTextClassifier(tmp_path / "q.bin")
    scores = [clf.score(t, "positive") for t in good[200:] + bad[200:]]
    truth = [True] * 100 + [False] * 100
    acc = sum((s >= 0.5) == t for s, t in zip(scores, truth)) / len(truth)
    assert acc > 0.9  # chance is 0.5
    label, score = clf.predict(good[250])
    assert label == "positive" and 0.5 < score <= 1.0
    docs = [Document(good[201], "g"), Document(bad[201], "b")]
    st = StepStats("quality")
    kept = list(
        ClassifierFilter(tmp_path / "q.bin", label="positive", drop_if_label=False)(docs, st)
    )
    assert [d.id for d in kept] == ["g"] and st.dropped == {"quality_below_threshold": 1}
    with pytest.raises(ValueError, match="both classes"):
        train_fasttext(good, [], tmp_path / "x.bin")
    with pytest.raises(FileNotFoundError, match="train-classifier"):
        FastTextClassifier(tmp_path / "missing.bin")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nsfw", "toxic"])
def test_generated_harm_classifiers_on_held_out_generated_data(kind, tmp_path):
    clf = builtin_classifier(kind, cache_dir=tmp_path)
    pos, neg = generated_examples(kind, n=200, seed=1)  # another seed than training
    p, r = precision_recall(
        [clf.score(t, kind) for t in pos + neg], [True] * 200 + [False] * 200, 0.5
    )
    assert p > 0.9 and r > 0.9
    assert clf.score("The library opens at nine and the staff were friendly.", kind) < 0.5


def test_precision_recall_hand_worked():
    assert precision_recall([0.9, 0.8, 0.2, 0.6], [True, False, True, True], 0.5) == (2 / 3, 2 / 3)


class ByteTokenizer:
    def encode(self, text):
        return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def tiny_lm():
    from lmstack.model.config import ModelConfig
    from lmstack.model.transformer import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=128)
    return Transformer(cfg).eval()


def test_perplexity_scorer_equals_torch_cross_entropy(tiny_lm):
    text = "The committee reviewed the annual report."
    ids = torch.tensor([list(text.encode())])
    with torch.no_grad():
        logits = tiny_lm(ids).float()
    want = math.exp(F.cross_entropy(logits[0, :-1], ids[0, 1:]).item())
    got = PerplexityScorer(tiny_lm, ByteTokenizer())(text)
    assert got == pytest.approx(want, rel=1e-4)


def test_perplexity_filter_threshold_and_percentile(tiny_lm):
    scorer = PerplexityScorer(tiny_lm, ByteTokenizer())
    texts = [f"Sentence number {i} with some words." * (1 + i % 3) for i in range(10)]
    ppl = [scorer(t) for t in texts]
    docs = [Document(t, str(i)) for i, t in enumerate(texts)]
    median = sorted(ppl)[4]
    kept = list(PerplexityFilter(scorer, max_perplexity=median)(docs, StepStats("p")))
    assert {d.id for d in kept} == {str(i) for i, p in enumerate(ppl) if p <= median}
    docs = [Document(t, str(i)) for i, t in enumerate(texts)]
    kept = list(
        PerplexityFilter(scorer, keep_fraction=0.3, calibration_docs=10)(docs, StepStats("p"))
    )
    assert {d.id for d in kept} == {str(i) for i in sorted(range(10), key=lambda i: ppl[i])[:3]}
    with pytest.raises(ValueError, match="exactly one"):
        PerplexityFilter(scorer)


def test_train_classifier_command(tmp_path, capsys):
    from lmstack.data.cli_filters import main

    rng = random.Random(1)
    (tmp_path / "good.txt").write_text("\n".join(" ".join(prose(rng, (1, 1))) for _ in range(100)))
    (tmp_path / "bad.jsonl").write_text("\n".join(f'{{"text": "{spam(rng)}"}}' for _ in range(100)))
    out = tmp_path / "q.bin"
    assert (
        main(
            [
                "train-classifier",
                "--positive",
                str(tmp_path / "good.txt"),
                "--negative",
                str(tmp_path / "bad.jsonl"),
                "--out",
                str(out),
                "--epoch",
                "10",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert (
        out.is_file()
        and "held out (10 + 10): threshold 0.5: precision 1.000 recall 1.000" in printed
    )
    assert (
        main(
            [
                "train-classifier",
                "--positive",
                str(tmp_path / "none.txt"),
                "--negative",
                str(tmp_path / "bad.jsonl"),
                "--out",
                str(out),
            ]
        )
        == 2
    )
    assert "none.txt: no such file" in capsys.readouterr().err


def test_perplexity_filter_from_a_toml_table(tiny_lm, tmp_path):
    """From a pipeline TOML the filter names a checkpoint directory and its tokenizer; the model is loaded
    where the task runs (the pickled step carries no model) and scores as the in-memory model does."""
    import pickle

    from lmstack.data.pipeline import build_step
    from lmstack.model.io import save_pretrained
    from lmstack.tokenizer import Tokenizer, save

    save_pretrained(tiny_lm, tmp_path / "ckpt")
    save(Tokenizer({i: bytes([i]) for i in range(256)}, []), tmp_path / "ckpt" / "tokenizer.json")
    texts = [f"Sentence number {i} with some words." * (1 + i % 3) for i in range(6)]
    want = [PerplexityScorer(tiny_lm, ByteTokenizer())(t) for t in texts]  # the byte ids, directly
    cut = sorted(want)[2]
    step = build_step(
        {"type": "perplexity_filter", "model": str(tmp_path / "ckpt"), "max_perplexity": cut}
    )
    step = pickle.loads(pickle.dumps(step))
    assert len(pickle.dumps(step)) < 2000  # no weights travel with the step
    kept = list(step([Document(t, str(i)) for i, t in enumerate(texts)], StepStats("p")))
    assert {d.id for d in kept} == {str(i) for i, p in enumerate(want) if p <= cut}
    assert [d.metadata["perplexity"] for d in kept] == pytest.approx(
        [p for p in want if p <= cut], rel=1e-4
    )
    with pytest.raises(FileNotFoundError, match="model='nope'"):
        build_step({"type": "perplexity_filter", "model": "nope", "max_perplexity": 10.0})
    with pytest.raises(ValueError, match="exactly one of scorer"):
        PerplexityFilter(max_perplexity=10.0)
