"""The one ``lmstack`` command. Each chapter contributes subcommands from its own ``cli`` module.

A chapter module ``lmstack.<chapter>.cli`` defines ``register(subparsers)``, which adds its
subcommands with ``set_defaults(func=...)``; ``func(args)`` returns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from lmstack import __version__
from lmstack.threads import set_threads
from lmstack.train.cli import split_resume
from lmstack.utils import MissingExtraError

# Chapters in the order the help lists them; each names the module whose ``register`` adds its commands.
CHAPTERS = {
    "demo": "lmstack.demo",
    "inference": "lmstack.inference.cli",
    "tokenizer": "lmstack.tokenizer.cli",
    "accounting": "lmstack.accounting.cli",
    "train": "lmstack.train.cli",
    "align": "lmstack.align.cli",
    "kernels": "lmstack.kernels.cli",
    "parallel": "lmstack.parallel.cli",
    "quant": "lmstack.quant.cli",
    "scaling": "lmstack.scaling.cli",
    "eval": "lmstack.eval.cli",
    "serve": "lmstack.serve.cli",
    "data": "lmstack.data.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmstack",
        description="lmstack: tokenizer, model, training, parallelism, kernels, inference and serving, "
        "quantisation, evaluation, accounting and scaling laws.",
    )
    parser.add_argument("--version", action="version", version=f"lmstack {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module in CHAPTERS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "lm_eval_args"):  # `eval harness --help`: every word is lm-eval's
        args.lm_eval_args, extra = extra + list(args.lm_eval_args), []
    if extra and not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    try:
        if (
            extra
        ):  # key=value overrides argparse left after an optional-argument flag (train --resume)
            split_resume(args, extra)
        if hasattr(args, "threads"):  # every command that computes has --threads
            set_threads(args.threads)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, OSError, MissingExtraError) as e:
        # Bad input (config, files, requests) or a missing extra: a clear message, not a deep traceback.
        print(f"lmstack: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
