"""What the data buys: the same small lmstack model, trained for the same steps on the demo crawl before and
after the pipeline, evaluated on clean held-out text.

  .venv/bin/python benchmarks/data_value.py --demo data-demo --json docs/data_value.json   # ~4 minutes

- **before**: the crawl's raw extracted text (``DIR/extracted``: every page extraction kept, any language,
  spam, boilerplate-only lists, duplicates, PII);
- **after**: the pipeline's output (``DIR/clean``: language, quality rules, PII, NSFW/toxic, exact + MinHash
  dedup).

``DIR`` is a ``lmstack data demo`` folder (made here when it has no ``filters_report.json``). One byte-level BPE
(vocabulary ``--vocab``) trained on the raw text — the superset, so neither side gets a tokenizer fitted to it
alone — encodes both training sets and both held-out sets. The model (D=128, L=2, N=4, K=2, F=384, tied
embeddings, fp32, one thread) is trained ``--steps`` steps of B=16 x S=128 tokens with AdamW and a cosine
schedule, seed 0, on each; the smaller set is repeated (the same tokens seen per step). Validation loss
(mean cross-entropy per token, nats) on two held-out sets, neither in the crawl:

- *held-out prose*: 100 pages of the generator's clean prose drawn with another seed (``corpus.prose``): the
  kind of text the crawl's wanted pages are;
- *held-out documentation*: English HTML documentation pages on this machine that the crawl did not take
  (``corpus.REAL_HTML_GLOBS``), extracted by the same ``extract`` step, the first 8000 characters of each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from glob import glob
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

SEP = "<|endoftext|>"


def records_of(folder: Path) -> list[dict]:
    from lmstack.data.writers import read_records

    return [r for f in sorted(folder.glob("*.jsonl*")) for r in read_records(f)]


def texts_of(folder: Path) -> list[str]:
    return [r["text"] for r in records_of(folder)]


def mix_by_route(records: list[dict], shares: dict[str, float]) -> tuple[list[str], dict]:
    """The pipeline's documents with each route's documents repeated so that the routes' UTF-8 bytes come
    near ``shares`` (a mixture by rules, as Dolma's mixer or The Pile's epochs per component): no route is
    cut, the largest one relative to its share is taken once, every other route ``round(factor)`` times
    (at least once). Documents without a route count as ``prose``. Returns the texts and the shares made."""
    by: dict[str, list[str]] = {}
    for r in records:
        by.setdefault(r["metadata"].get("route", "prose"), []).append(r["text"])
    if set(by) - set(shares):
        raise ValueError(f"routes {sorted(set(by) - set(shares))} have no share in {shares}")
    size = {k: sum(len(t.encode()) for t in v) for k, v in by.items()}
    total = max(size[k] / shares[k] for k in by)  # the mixture's bytes when no route is cut
    reps = {k: max(1, round(shares[k] * total / size[k])) for k in by}
    texts = [t for r in records for t in [r["text"]] * reps[r["metadata"].get("route", "prose")]]
    made = {k: size[k] * reps[k] for k in by}
    return texts, {
        "repeats": reps,
        "shares": {k: round(v / sum(made.values()), 3) for k, v in made.items()},
    }


def heldout_docs(crawl_urls: set[str], limit: int, max_chars: int = 8000) -> list[str]:
    """English documentation pages not in the crawl, extracted like the crawl's (the first ``max_chars``
    characters of each: a few long pages would otherwise be most of the set)."""
    from lmstack.data.corpus import REAL_HTML_GLOBS
    from lmstack.data.document import Document
    from lmstack.data.extract import Extract
    from lmstack.data.step import StepStats

    files = []
    for pattern in REAL_HTML_GLOBS:
        for f in sorted(glob(pattern, recursive=True)):
            name = Path(f).name.split(".")
            english = "debian-reference" not in f or (len(name) >= 3 and name[-2] == "en")
            if (
                english
                and f"http://docs.local{f}" not in crawl_urls
                and Path(f).stat().st_size > 2000
                and f not in files
            ):
                files.append(f)
    random.Random(1).shuffle(files)
    step, out, seen = Extract(), [], set()
    for f in files:
        data = Path(f).read_bytes()
        doc = step.apply(
            Document("", f, {"raw": data, "content_type": "text/html"}), StepStats("extract")
        )
        if len(doc.text) > 500 and doc.text not in seen:
            seen.add(doc.text)
            out.append(doc.text[:max_chars])
        if len(out) >= limit:
            break
    return out


def heldout_prose(n: int) -> list[str]:
    from lmstack.data.corpus import prose

    rng = random.Random(12345)
    return ["\n\n".join(prose(rng)) for _ in range(n)]


def encode(tok, texts: list[str], path: Path) -> int:
    import numpy as np

    from lmstack.tokenizer import token_dtype
    from lmstack.tokenizer.token_file import write_sidecar

    eos = tok.special_tokens[SEP]
    ids = [i for t in texts for i in tok.encode(t) + [eos]]
    dtype = token_dtype(tok.vocab_size)
    np.asarray(ids, dtype=dtype).tofile(path)
    write_sidecar(
        path,
        {
            "dtype": np.dtype(dtype).name,
            "n_tokens": len(ids),
            "vocab_size": tok.vocab_size,
            "eos_id": eos,
        },
    )
    return len(ids)


def train_and_eval(
    train: Path,
    heldout: dict[str, Path],
    steps: int,
    out_dir: Path,
    vocab: int,
    eos: int,
    seed: int = 0,
) -> dict:
    import torch

    from lmstack.tokenizer import open_tokens
    from lmstack.train import TrainConfig, Trainer

    torch.set_num_threads(1)
    B, S = 16, 128
    first = next(iter(heldout.values()))
    cfg = TrainConfig(
        model=dict(
            d_model=128,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_ff=384,
            max_seq_len=S,
            tie_embeddings=True,
            vocab_size=vocab,
        ),
        train_data=str(train),
        val_data=str(first),
        sep_id=eos,
        batch_size=B,
        seq_len=S,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=20,
        max_steps=steps,
        precision="fp32",
        device="cpu",
        eval_interval=10**9,
        eval_batches=1,
        log_interval=50,
        out_dir=str(out_dir),
        keep_last=1,
        seed=seed,
    )
    t0 = time.perf_counter()
    trainer = Trainer(cfg, progress=False, overwrite=True)
    summary = trainer.fit()
    res = {
        "train_tokens": len(trainer.train_tokens),
        "seconds": round(time.perf_counter() - t0, 1),
        "final_train_loss": summary.get("train_loss", summary.get("loss")),
    }
    for name, path in heldout.items():
        trainer.val_tokens = open_tokens(path)
        windows = max(1, (len(trainer.val_tokens) - 1) // (B * S))
        res[name] = trainer.evaluate(max_batches=windows)["val_loss"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--demo", default="data-demo", help="a `lmstack data demo` folder (made when missing)"
    )
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--heldout-docs", type=int, default=40)
    ap.add_argument(
        "--mix",
        default="prose=0.5,code=0.5",
        help="route shares of the pipeline's output in training ('none': as the pipeline left it)",
    )
    ap.add_argument(
        "--runs", default="raw,clean", help="which training runs (raw, clean, comma-separated)"
    )
    ap.add_argument("--seed", type=int, default=0, help="the training runs' seed")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)

    from lmstack.data.corpus import read_labels
    from lmstack.tokenizer import Tokenizer, train_bpe

    demo = Path(args.demo)
    if not (demo / "filters_report.json").is_file():
        from lmstack.data.demo import run_demo

        run_demo(demo, quiet=True)
    raw, clean_records = texts_of(demo / "extracted"), records_of(demo / "clean")
    clean, mix = [r["text"] for r in clean_records], None
    if args.mix != "none":
        shares = {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(","))}
        clean, mix = mix_by_route(clean_records, shares)
        print(f"mixture of the pipeline's output by route: {mix}")
    docs = heldout_docs(set(read_labels(demo / "crawl")), args.heldout_docs)
    prose = heldout_prose(100)
    result = {"load_average": os.getloadavg(), "steps": args.steps, "seed": args.seed, "mix": mix}
    with tempfile.TemporaryDirectory(prefix="data_value_") as tmp:
        tmp = Path(tmp)
        (tmp / "raw.txt").write_text("\n\n".join(raw), encoding="utf-8")
        t0 = time.perf_counter()
        vocab, merges = train_bpe(tmp / "raw.txt", args.vocab, [SEP], "gpt2", progress=False)
        tok = Tokenizer(vocab, merges, [SEP], pattern="gpt2")
        print(f"BPE V={tok.vocab_size} on the raw text in {time.perf_counter() - t0:.1f} s")
        sets = {"raw": raw, "clean": clean, "heldout_prose": prose, "heldout_docs": docs}
        paths = {}
        for name, texts in sets.items():
            paths[name] = tmp / f"{name}.bin"
            n = encode(tok, texts, paths[name])
            mb = sum(len(t.encode()) for t in texts) / 1e6
            result[name] = {"documents": len(texts), "mb": round(mb, 3), "tokens": n}
            print(f"{name}: {len(texts)} documents, {mb:.2f} MB, {n:,} tokens")
        held = {"heldout_prose": paths["heldout_prose"], "heldout_docs": paths["heldout_docs"]}
        for name in args.runs.split(","):
            r = train_and_eval(
                paths[name],
                held,
                args.steps,
                tmp / f"run_{name}",
                tok.vocab_size,
                tok.special_tokens[SEP],
                args.seed,
            )
            result[f"train_{name}"] = r
            print(
                f"trained on {name} ({r['train_tokens']:,} tokens, {args.steps} steps, {r['seconds']} s): "
                f"held-out prose loss {r['heldout_prose']:.3f}, held-out documentation loss {r['heldout_docs']:.3f}"
            )
    for h in ("heldout_prose", "heldout_docs") if args.runs == "raw,clean" else ():
        d = result["train_raw"][h] - result["train_clean"][h]
        print(
            f"{h}: raw {result['train_raw'][h]:.3f} -> clean {result['train_clean'][h]:.3f} nats/token "
            f"({d:+.3f}; perplexity x{2.718281828**-d:.2f})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
