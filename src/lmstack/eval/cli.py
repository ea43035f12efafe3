"""``lmstack eval ...``: perplexity / bits per byte (``ppl``), task files (``run``), lm-evaluation-harness
(``harness``), arena ratings (``arena``) and contamination tests (``contamination``). docs/eval.md."""

from __future__ import annotations

import argparse
import json

from lmstack.eval import contamination as C
from lmstack.eval.arena import plot_ratings, rate, read_battles
from lmstack.eval.contamination import clean_rescore
from lmstack.eval.datasets import make_data
from lmstack.eval.judge import battles, read_questions, write_battles
from lmstack.eval.perplexity import perplexity, read_eval_tokens
from lmstack.eval.runner import Evaluator, run_task, table
from lmstack.eval.tasks import load_task
from lmstack.inference.loader import add_model_arguments, load_for_inference, model_tokenizer
from lmstack.threads import add_threads_argument
from lmstack.tokenizer import is_token_file
from lmstack.utils import (
    atomic_write_text,
    check_outputs,
    finite_float,
    is_json_file,
    is_png_file,
    own_folder_kind,
    positive_int,
)


def _model_args(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_threads_argument(p)


def _load(args):
    """The model and tokenizer; ``--max-length`` (where the command has it) checked against the context."""
    model, tok = load_for_inference(args.model, args.tokenizer, args.dtype)
    ctx = model.config.max_seq_len
    if getattr(args, "max_length", None) is not None and args.max_length > ctx:
        raise ValueError(
            f"--max-length {args.max_length} exceeds the context of {args.model} ({ctx} tokens, its "
            "max_seq_len)"
        )
    return model, tok


def _write_json(path, obj, inputs) -> None:
    check_outputs([("--json", path)], inputs, {"--json": ("a JSON file", is_json_file)})
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


def register(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser(
        "eval", help="evaluate models: perplexity, tasks, lm-eval, arena ratings, contamination"
    )
    esub = ev.add_subparsers(title="eval commands", metavar="EVAL_COMMAND")

    p = esub.add_parser(
        "ppl", help="perplexity and bits per byte on a text or token file (strided windows)"
    )
    p.add_argument("data", help="UTF-8 text file, or a token file (with its .json sidecar)")
    _model_args(p)
    p.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        help="window length (default: the model's context)",
    )
    p.add_argument(
        "--stride",
        type=positive_int,
        default=None,
        help="tokens between window starts (default: max-length/2)",
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=None, help="evaluate only the first N tokens"
    )
    p.add_argument("--add-bos", action="store_true", help="put the model's BOS token first")
    p.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="windows per forward (default: 8192 tokens' worth, ≤ 32)",
    )
    p.add_argument("--json", default=None, help="write the result here")
    p.set_defaults(func=run_ppl)

    r = esub.add_parser(
        "run",
        help="run task files (YAML spec or JSONL items): multiple choice, loglikelihood, generate",
    )
    r.add_argument("tasks", nargs="+", help="task files (.yaml/.yml spec or .jsonl items)")
    _model_args(r)
    r.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        help="context length (default: the model's)",
    )
    r.add_argument(
        "--limit", type=positive_int, default=None, help="only the first N items of each task"
    )
    r.add_argument("--json", default=None, help="write the results here")
    r.add_argument("--samples", action="store_true", help="include per-item records in the JSON")
    r.set_defaults(func=run_tasks)

    a = esub.add_parser(
        "arena",
        help="ratings from pairwise battles: online Elo, Bradley-Terry with bootstrap CIs, PNG",
    )
    a.add_argument(
        "battles", help="JSONL: model_a, model_b, winner (model_a | model_b | tie | tie (bothbad))"
    )
    a.add_argument(
        "--bootstrap", type=positive_int, default=200, help="bootstrap resamples for the intervals"
    )
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--k", type=finite_float, default=4.0, help="online Elo step")
    a.add_argument("--json", default=None, help="write the ratings here")
    a.add_argument("--png", default=None, help="plot the ratings with their intervals here")
    a.set_defaults(func=run_arena)

    c = esub.add_parser(
        "contamination",
        help="train-test contamination: exchangeability test (Oren et al. 2023) "
        "or n-gram overlap with a training corpus",
    )
    c.add_argument("method", choices=["exchangeability", "overlap"])
    c.add_argument(
        "task", help="task file (.yaml/.jsonl): its items, in file order, are the benchmark"
    )
    _model_args(c)
    c.add_argument(
        "--permutations",
        type=positive_int,
        default=99,
        help="exchangeability: random orders to compare",
    )
    c.add_argument(
        "--shards",
        type=int,
        default=0,
        help="exchangeability: also the sharded t-test with this many",
    )
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        help="context length (default: the model's)",
    )
    c.add_argument(
        "--train",
        default=None,
        help="overlap: the training corpus (text file, or token file + sidecar)",
    )
    c.add_argument(
        "--n",
        type=positive_int,
        default=13,
        help="overlap: n-gram length (words for text, tokens for token files)",
    )
    c.add_argument(
        "--results",
        default=None,
        help="overlap: a `lmstack eval run --samples` JSON to re-score on the clean items",
    )
    c.add_argument("--json", default=None, help="write the result here")
    c.set_defaults(func=run_contamination)

    j = esub.add_parser(
        "judge",
        help="pairwise LLM-as-judge: models answer prompts, a judge compares each pair in "
        "both positions; battles JSONL + arena ratings",
    )
    j.add_argument("prompts", help="JSONL with a 'prompt' string a line")
    j.add_argument(
        "--contestant",
        action="append",
        required=True,
        metavar="NAME=MODEL",
        help="a model to rate (repeat; at least 2): name=model name, .gguf or checkpoint dir",
    )
    add_model_arguments(j, model_flag="--judge", model_help="the judge model", tokenizer=False)
    j.add_argument("--max-tokens", type=positive_int, default=64, help="answer length")
    j.add_argument(
        "--battles",
        required=True,
        help="write the battles JSONL here (input of `lmstack eval arena`)",
    )
    add_threads_argument(j)
    j.set_defaults(func=run_judge)

    m = esub.add_parser(
        "make-data",
        help="build the offline evaluation sets (stdlib held-out text, docstring "
        "multiple choice) with provenance.json",
    )
    m.add_argument("out", help="output directory")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--heldout-bytes", type=positive_int, default=48_000)
    m.add_argument(
        "--force", action="store_true", help="write into OUT even when it holds other files"
    )
    m.set_defaults(func=run_make_data)

    h = esub.add_parser(
        "harness",
        add_help=False,  # --help after `run` is lm-eval's own; `harness --help` prints HARNESS_HELP
        help="lm-evaluation-harness's command line with model `lmstack` registered "
        "(lmstack eval harness run --model lmstack --model_args model=smollm2-135m --tasks T ...)",
    )
    h.add_argument(
        "lm_eval_args",
        nargs=argparse.REMAINDER,
        help="an lm-eval subcommand (run, ls, validate) and its arguments",
    )
    h.set_defaults(func=run_harness)
    ev.set_defaults(func=lambda args: ev.print_help() or 0)


def run_ppl(args) -> int:

    if args.json:
        check_outputs(
            [("--json", args.json)],
            [("the data", args.data)],
            {"--json": ("a JSON file", is_json_file)},
        )
    model, tok = _load(args)
    bos = model.config.bos_token_id if args.add_bos else None
    if args.add_bos and bos is None:
        raise ValueError(f"--add-bos: model {args.model} has no bos_token_id")
    ids = read_eval_tokens(args.data, tok, add_bos=bos, max_tokens=args.max_tokens)
    r = perplexity(
        model, ids, args.max_length, args.stride, tokenizer=tok, batch_windows=args.batch
    )
    bpb = f"{r.bits_per_byte:.4f}" if r.bits_per_byte is not None else "n/a"
    print(
        f"perplexity {r.perplexity:.4f}  bits/byte {bpb}  tokens {r.n_tokens}  windows {r.n_windows} "
        f"(max_length {r.max_length}, stride {r.stride})  {r.tokens_per_s:.0f} tokens/s"
    )
    if args.json:
        _write_json(
            args.json,
            {"data": str(args.data), "model": str(args.model), "dtype": args.dtype, **r.to_dict()},
            [("the data", args.data)],
        )
    return 0


def run_tasks(args) -> int:

    inputs = [("a task file", t) for t in args.tasks]
    if args.json:
        check_outputs([("--json", args.json)], inputs, {"--json": ("a JSON file", is_json_file)})
    tasks = [load_task(t) for t in args.tasks]  # every file checked before the model loads
    if args.limit is not None:
        for t in tasks:
            t.items = t.items[: args.limit]
    model, tok = _load(args)
    ev = Evaluator(model, tok, args.max_length)
    results = [run_task(t, ev) for t in tasks]
    print(table(results))
    if args.json:
        _write_json(
            args.json,
            {
                "model": str(args.model),
                "dtype": args.dtype,
                "results": [r.to_dict(args.samples) for r in results],
            },
            inputs,
        )
    return 0


HARNESS_HELP = """usage: lmstack eval harness {run,ls,validate} [lm-eval arguments ...]

lm-evaluation-harness's own command line (pip install lm-eval), with the model type `lmstack`
registered. Examples:
  lmstack eval harness run --model lmstack --model_args model=smollm2-135m,dtype=int8 --tasks hellaswag
  lmstack eval harness ls tasks
--model_args keys: model, tokenizer, dtype, max_length, max_gen_toks, max_batch_tokens (and lm-eval's
batch_size, max_batch_size, device). lm-eval's own options: lmstack eval harness run --help."""


def run_harness(args) -> int:
    argv = list(args.lm_eval_args)
    if not argv or argv[0] in (
        "-h",
        "--help",
        "help",
    ):  # before the optional import: help always works
        print(HARNESS_HELP)
        return 0
    try:
        from lmstack.eval.harness import run_lm_eval  # lm-evaluation-harness is optional
    except ImportError as e:
        raise ValueError(
            f"lmstack eval harness needs lm-evaluation-harness ({e}): pip install lm-eval"
        ) from None
    argv = list(args.lm_eval_args)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[0] not in ("run", "ls", "validate"):
        raise ValueError(
            f"lmstack eval harness: start with an lm-eval subcommand (run, ls, validate), got {argv[:1]}"
        )
    run_lm_eval(argv)
    return 0


def run_arena(args) -> int:
    import sys

    ins = [("the battles file", args.battles)]
    check_outputs(
        [("--json", args.json), ("--png", args.png)],
        ins,
        {"--json": ("a JSON file", is_json_file), "--png": ("a PNG file", is_png_file)},
    )
    if args.bootstrap < 0:
        raise ValueError(f"--bootstrap={args.bootstrap} must be >= 0")
    battles = read_battles(args.battles)
    for w in battles.warnings:
        print(f"warning: {w}", file=sys.stderr)
    result = rate(battles, args.bootstrap, args.seed, args.k)
    for w in result.warnings[len(battles.warnings) :]:  # separation, a disconnected graph
        print(f"warning: {w}", file=sys.stderr)
    print(result.table())
    if args.json:
        _write_json(args.json, result.to_dict(), ins)
    if args.png:
        plot_ratings(result, args.png)
        print(f"wrote {args.png}")
    return 0


def _item_texts(task) -> list[str]:
    return [it.context + task.target_delimiter + it.target() for it in task.items]


def run_contamination(args) -> int:

    ins = [("the task", args.task), ("--train", args.train), ("--results", args.results)]
    if args.json:
        check_outputs([("--json", args.json)], ins, {"--json": ("a JSON file", is_json_file)})
    task = load_task(args.task)
    results = _read_results(args.results) if args.results else None  # before any long work
    texts = _item_texts(task)
    if args.method == "exchangeability":
        model, tok = _load(args)
        examples = [
            tok.encode(t + "\n") for t in texts
        ]  # one example a line, as the file lists them
        r = C.permutation_test(
            model, examples, args.permutations, args.seed, max_length=args.max_length, progress=True
        )
        if args.shards:
            r.sharded_p_value, r.shard_differences = C.sharded_test(
                model,
                examples,
                args.shards,
                seed=args.seed,
                max_length=args.max_length,
                progress=True,
            )
        print(
            f"{task.name}: {len(examples)} examples; canonical log-likelihood {r.canonical_loglik:.2f} vs "
            f"permuted mean {sum(r.permuted_logliks) / len(r.permuted_logliks):.2f}; permutation p = {r.p_value:.4f}"
            + (f"; sharded ({args.shards}) p = {r.sharded_p_value:.4g}" if args.shards else "")
        )
        out = {
            "task": task.name,
            "method": "exchangeability",
            "model": str(args.model),
            **r.to_dict(),
        }
    else:
        if not args.train:
            raise ValueError("overlap needs --train FILE (a text corpus or a token file)")
        if is_token_file(args.train, strict=True):
            tok = model_tokenizer(args.model, args.tokenizer)
            r = C.ngram_overlap([tok.encode(t) for t in texts], C.token_chunks(args.train), args.n)
        else:
            r = C.ngram_overlap(
                [C.normalize_words(t) for t in texts], C.text_chunks(args.train), args.n
            )
        print(
            f"{task.name}: {r.contaminated} of {len(texts)} items share a {args.n}-gram with {args.train} "
            f"({sum(f is None for f in r.flags)} shorter than {args.n})"
        )
        out = {
            "task": task.name,
            "method": "overlap",
            "train": str(args.train),
            **r.to_dict(),
            "flagged_lines": [it.line for it, f in zip(task.items, r.flags) if f],
        }
        if args.results:
            out["rescore"] = _rescore(args.results, results, task, r.flags)
            for metric, d in out["rescore"].items():
                print(
                    f"  {metric}: all {d['all']:.4f}  clean {d['clean']:.4f} (n={d['n_clean']})  "
                    f"contaminated {d['contaminated']:.4f} (n={d['n_contaminated']})"
                )
    if args.json:
        _write_json(args.json, out, ins)
    return 0


def _read_results(path) -> list:
    """The ``results`` list of an ``lmstack eval run --json`` file; errors name ``--results`` and the file."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"--results {path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"--results {path}: not a JSON file of `lmstack eval run --samples --json` ({e})"
        ) from None
    if not isinstance(d, dict) or not isinstance(d.get("results"), list):
        raise ValueError(
            f"--results {path}: expected the JSON object `lmstack eval run --samples --json` writes "
            f"(with a 'results' list), got {type(d).__name__}"
        )
    return [r for r in d["results"] if isinstance(r, dict)]


def _rescore(path, results, task, flags) -> dict:

    mine = [r for r in results if r.get("name") == task.name and r.get("samples")]
    if not mine:
        raise ValueError(
            f"{path}: no results with samples for task {task.name!r} (run `lmstack eval run --samples`)"
        )
    by_line = {s["line"]: s for s in mine[0]["samples"]}
    if set(by_line) != {it.line for it in task.items}:
        raise ValueError(
            f"{path}: its samples do not cover the items of {task.path} (different file or --limit?)"
        )
    samples = [by_line[it.line] for it in task.items]
    metrics = {
        "multiple_choice": {
            "acc": lambda s: s["pred"] == s["answer"],
            "acc_norm": lambda s: s["pred_norm"] == s["answer"],
        },
        "loglikelihood": {"acc": lambda s: s["greedy"], "loglik": lambda s: s["loglik"]},
        "generate": {"exact_match": lambda s: s["extracted"] == str(s["answer"]).strip()},
    }[task.kind]
    return {m: clean_rescore(samples, fn, flags) for m, fn in metrics.items()}


def run_make_data(args) -> int:

    check_outputs(
        [("the output folder", args.out)],
        [],
        {
            "the output folder": own_folder_kind(
                "eval make-data", "provenance.json", "stdlib_heldout.txt"
            )
        },
        force=args.force,
    )
    prov = make_data(args.out, args.seed, args.heldout_bytes)
    print(
        f"{args.out}: stdlib_heldout.txt ({prov['stdlib_heldout.txt']['bytes']} bytes, "
        f"{len(prov['stdlib_heldout.txt']['files'])} files), stdlib_docstring_mc.jsonl "
        f"({prov['stdlib_docstring_mc.jsonl']['items']} items) from Python {prov['python']}"
    )
    return 0


def run_judge(args) -> int:

    check_outputs([("--battles", args.battles)], [("the prompts", args.prompts)])
    contestants = {}
    for spec in args.contestant:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--contestant {spec!r}: expected NAME=MODEL")
        if name in contestants:
            raise ValueError(f"--contestant: the name {name!r} is given twice")
        contestants[name] = path
    if len(contestants) < 2:
        raise ValueError("--contestant: give at least two models to compare")
    questions = read_questions(args.prompts)
    answers = {}
    for name, path in contestants.items():
        ev = Evaluator(*load_for_inference(path, None, args.dtype))
        answers[name] = ev.generate(
            [f"Question: {q}\nAnswer:" for q in questions], ["\n\n"], args.max_tokens, progress=True
        )
        del ev
    judge = Evaluator(*load_for_inference(args.judge, None, args.dtype))
    write_battles(args.battles, battles(answers, questions, judge))
    print(f"wrote {args.battles}")
    print(rate(read_battles(args.battles), n_bootstrap=100, progress=False).table())
    return 0
