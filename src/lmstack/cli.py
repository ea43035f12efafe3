"""The one ``lmstack`` command. Each chapter contributes subcommands from its own ``cli`` module.

A chapter module ``lmstack.<chapter>.cli`` defines ``register(subparsers)``, which adds its
subcommands with ``set_defaults(func=...)``; ``func(args)`` returns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# Chapters in the order the help lists them; a chapter without a cli module is skipped.
CHAPTERS = ["demo", "inference", "tokenizer", "accounting", "train", "kernels", "parallel", "scaling", "eval"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmstack",
        description="lmstack: tokenizer, Llama-family model, training, parallelism, kernels, inference, accounting.",
    )
    from lmstack import __version__

    parser.add_argument("--version", action="version", version=f"lmstack {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    for chapter in CHAPTERS:
        name = f"lmstack.{chapter}" if chapter != "demo" else "lmstack.demo"
        mod_name = name if chapter == "demo" else f"{name}.cli"
        if importlib.util.find_spec(name) is None or (
            chapter != "demo" and importlib.util.find_spec(mod_name) is None
        ):
            continue
        importlib.import_module(mod_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    try:
        if extra:  # key=value overrides argparse left after an optional-argument flag (train --resume)
            from lmstack.train.cli import split_resume

            split_resume(args, extra)
        if hasattr(args, "threads"):  # every command that computes has --threads
            from lmstack.threads import set_threads

            set_threads(args.threads)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, OSError) as e:
        # Bad input (config, files, requests): a clear message, not a deep traceback.
        print(f"lmstack: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
