"""Command-line wiring for the filter half of ``lmstack data``: ``train-classifier`` and ``demo``.

``lmstack.data.cli`` (the pipeline's command module) calls :func:`add_subcommands` on its sub-parsers; each
sub-command's ``func`` takes the parsed arguments and returns an exit status.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def read_texts(paths: list[str]) -> list[str]:
    """Texts from .jsonl(.gz) files (their ``text`` field) or plain text files (one text per non-empty line)."""
    import gzip

    out: list[str] = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file of example texts")
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as fh:
            if ".jsonl" in path.name:
                for i, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            out.append(json.loads(line)["text"])
                        except (json.JSONDecodeError, KeyError, TypeError) as e:
                            raise ValueError(
                                f"{path}:{i}: expected a JSON object with a 'text' field ({e})"
                            ) from e
            else:
                out.extend(line.strip() for line in fh if line.strip())
    return out


def train_classifier_main(args: argparse.Namespace) -> int:
    from lmstack.data.classifiers import FastTextClassifier, precision_recall, train_fasttext

    pos, neg = read_texts(args.positive), read_texts(args.negative)
    rng = random.Random(args.seed)
    rng.shuffle(pos)
    rng.shuffle(neg)
    k_pos, k_neg = int(len(pos) * args.holdout), int(len(neg) * args.holdout)
    train_fasttext(
        pos[k_pos:],
        neg[k_neg:],
        args.out,
        labels=(args.label, "negative"),
        epoch=args.epoch,
        lr=args.lr,
        word_ngrams=args.word_ngrams,
        dim=args.dim,
        seed=args.seed,
    )
    print(
        f"trained on {len(pos) - k_pos} positive and {len(neg) - k_neg} negative texts -> {args.out}"
    )
    if k_pos and k_neg:
        clf = FastTextClassifier(args.out)
        scores = [clf.score(t, args.label) for t in pos[:k_pos] + neg[:k_neg]]
        truth = [True] * k_pos + [False] * k_neg
        for th in (0.5, 0.7, 0.9):
            p, r = precision_recall(scores, truth, th)
            print(f"held out ({k_pos} + {k_neg}): threshold {th}: precision {p:.3f} recall {r:.3f}")
    return 0


def demo_main(args: argparse.Namespace) -> int:
    from lmstack.data.demo import run_demo
    from lmstack.utils import check_outputs, own_folder_kind

    # an earlier demo (its pipeline.toml or crawl/) resumes; another model's or run's folder is refused
    check_outputs(
        [("--out", args.out)],
        [],
        {"--out": own_folder_kind("data demo", "pipeline.toml", "crawl")},
        force=args.force,
    )
    kw = {"address": args.ray_address} if args.executor == "ray" else {}
    run_demo(
        args.out,
        real_limit=args.real_pages,
        n_files=args.files,
        workers=args.workers,
        executor=args.executor,
        tiny=args.tiny,
        **kw,
    )
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-classifier", help="train a fastText quality classifier on positive/negative texts"
    )
    p.add_argument(
        "--positive",
        nargs="+",
        required=True,
        help="text files (one text per line) or .jsonl with 'text'",
    )
    p.add_argument("--negative", nargs="+", required=True)
    p.add_argument("--out", required=True, help="model file to write (.bin)")
    p.add_argument(
        "--label", default="positive", help="name of the positive label (default: positive)"
    )
    p.add_argument(
        "--holdout", type=float, default=0.1, help="fraction held out to report precision/recall"
    )
    p.add_argument("--epoch", type=int, default=25)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--word-ngrams", type=int, default=2)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=train_classifier_main)
    d = sub.add_parser(
        "demo",
        help="build the labelled offline crawl, run the whole pipeline on it (filters, "
        "dedup, tokenize): funnel and every step's precision/recall",
    )
    d.add_argument(
        "--out",
        default="data-demo",
        help="folder for the crawl, the pipeline's outputs and the report",
    )
    d.add_argument(
        "--real-pages", type=int, default=120, help="real HTML pages from /usr/share (at most)"
    )
    d.add_argument("--files", type=int, default=4, help="WARC files to write (one task each)")
    d.add_argument(
        "--workers", type=int, default=2, help="tasks at once (local processes or Ray tasks)"
    )
    d.add_argument("--executor", choices=["local", "ray"], default="local")
    d.add_argument(
        "--ray-address", default=None, help="Ray cluster to join (default: start a local Ray)"
    )
    d.add_argument(
        "--tiny",
        action="store_true",
        help="a small crawl (16 clean pages, <= 8 real ones): seconds",
    )
    d.add_argument(
        "--force",
        action="store_true",
        help="write into --out even when it holds something else (another model, another run)",
    )
    d.set_defaults(func=demo_main)


def main(argv: list[str] | None = None) -> int:
    """``python -m lmstack.data.cli_filters ...`` until the pipeline's ``lmstack data`` wires these in."""
    parser = argparse.ArgumentParser(prog="lmstack data")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())


register = add_subcommands  # the name lmstack.data.cli's SUBCOMMANDS call
