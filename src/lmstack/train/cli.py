"""``lmstack train --config run.toml [key=value ...]``: train, evaluate, checkpoint, plot.

Also runs under torchrun (``torchrun --nproc_per_node 2 -m lmstack.train --config run.toml
parallel=ddp``): rank and world size come from the environment and only rank 0 writes files.
"""

from __future__ import annotations

import argparse
import os
import sys

from lmstack.inference.generate import stream_generate
from lmstack.inference.sampling import SamplingParams
from lmstack.threads import add_threads_argument, set_threads
from lmstack.tokenizer import load_tokenizer
from lmstack.train.config import TrainConfig, apply_overrides
from lmstack.train.run_dir import check_run_paths, refuse_existing_run
from lmstack.train.trainer import Trainer, TrainingDiverged


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model on token files (config file + key=value overrides)",
        description="Train a Llama-family model from a TOML/JSON config (see docs/training.md). "
        "Overrides: lr=3e-4 max_steps=200 model.n_layers=4 ...",
    )
    add_arguments(p)
    p.set_defaults(func=run_train)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML or JSON config file")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides, e.g. lr=1e-3 model.d_model=128",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="CHECKPOINT",
        help="continue from the run's latest checkpoint (or the given checkpoint directory)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an out_dir that holds a previous run: its checkpoints/, metrics.jsonl, "
        "config.json, model/ and loss_curve.png are deleted first (other files stay)",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar (and no MFU measurement)"
    )
    p.add_argument(
        "--sample", default=None, metavar="PROMPT", help="after training, sample from the model"
    )
    p.add_argument("--sample-tokens", type=int, default=64)
    add_threads_argument(p)


def split_resume(args: argparse.Namespace, extra: list[str] | None = None) -> None:
    """``--resume`` takes an optional CHECKPOINT: a ``key=value`` after it is an override, not a
    path (``--resume lr=1e-3`` resumes the latest checkpoint with lr=1e-3); ``extra`` are the
    ``key=value`` words argparse left over after such a ``--resume``."""
    r = args.resume
    if r not in (None, "latest") and "=" in r and not os.path.exists(r):
        args.overrides = [r] + list(args.overrides)
        args.resume = "latest"
    for word in extra or []:
        if "=" not in word or word.startswith("-"):
            raise ValueError(f"unrecognized argument {word!r} (overrides look like key=value)")
        args.overrides.append(word)


def run_train(args: argparse.Namespace) -> int:
    split_resume(args)
    if args.resume and args.overwrite:
        raise ValueError(
            "--resume continues the run in out_dir and --overwrite deletes it: pass one of them"
        )
    if args.config:
        config = TrainConfig.load(args.config, args.overrides)
    else:
        config = TrainConfig.from_dict(apply_overrides({}, args.overrides), where="overrides")
    if config.parallel and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        raise ValueError(
            f"parallel={config.parallel!r} trains with one process per rank, but this process was not "
            "started by torchrun (no RANK/WORLD_SIZE in the environment): launch it with "
            "`torchrun --nproc_per_node=N -m lmstack train --config ...` (docs/parallel.md)"
        )
    # a resumed run may read its own out_dir/config.json (rewritten by the same run)
    check_run_paths(config, None if args.resume else args.config)
    if (
        not args.resume and not args.overwrite
    ):  # before building anything (Trainer.fit checks again)
        refuse_existing_run(config.out_dir)
    tok = None
    if args.sample is not None:  # fail now, not after hours of training
        if not config.tokenizer:
            raise ValueError(
                "--sample needs tokenizer= in the config (the tokenizer to encode the prompt with)"
            )
        tok = load_tokenizer(config.tokenizer)
    trainer = Trainer(config, progress=not args.no_progress, overwrite=args.overwrite)
    if args.resume:
        step = trainer.resume(None if args.resume == "latest" else args.resume)
        if trainer.is_main:
            print(f"resumed at step {step}")
    if trainer.is_main:
        mc = trainer.model_config
        print(
            f"model: {trainer.raw_model.num_params():,} parameters (L={mc.n_layers}, D={mc.d_model}, "
            f"N={mc.n_heads}, K={mc.n_kv_heads}, F={mc.d_ff}, V={mc.vocab_size}); "
            f"{trainer.tokens_per_step:,} tokens/step; {len(trainer.train_tokens):,} training tokens"
        )
    try:
        summary = trainer.fit()
    except TrainingDiverged as e:
        print(f"lmstack train: {e}", file=sys.stderr)
        return 3
    if not trainer.is_main:
        return 0
    baseline = trainer.unigram_baseline()
    png = trainer.plot(baseline)
    model_dir = trainer.export()
    print(
        f"step {summary['step']}: validation loss {summary['val_loss']:.4f} (perplexity {summary['val_ppl']:.2f}); "
        f"unigram baseline {baseline:.4f}"
    )
    print(
        f"checkpoint  {summary['checkpoint']}\nmodel       {model_dir}\nmetrics     {summary['metrics']}\n"
        f"loss curve  {png}"
    )
    if tok is not None:
        print(args.sample, end="", flush=True)
        params = SamplingParams(
            max_tokens=args.sample_tokens, temperature=0.8, top_k=50, seed=config.seed
        )
        stream_generate(trainer.raw_model.eval(), tok, args.sample, params)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lmstack.train", description="lmstack training (torchrun-friendly)"
    )
    add_arguments(p)
    args, extra = p.parse_known_args(argv)
    try:
        split_resume(args, extra)
        set_threads(args.threads)
        return run_train(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"lmstack train: error: {e}", file=sys.stderr)
        return 2
