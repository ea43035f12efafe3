"""``lmstack tokenizer train | encode | info`` (CS336 notes "分词器"; Book of LLMs §5.3 “memmap loading and bf16/int8 weights” memmap token files)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lmstack.threads import add_threads_argument, available_cpus
from lmstack.utils import (
    check_outputs,
    file_starts_with,
    is_json_file,
    own_folder,
    stdlib_root,
)

from . import formats
from .dataset import encode_files
from .pretokenize import PATTERNS
from .token_file import is_token_file
from .tokenizer import Tokenizer
from .train import train_bpe

GPT2_FILES = {"vocab.json", "merges.txt"}  # all that --format gpt2 writes into --out


def _expand(inputs: list[str], glob: str) -> list[Path]:
    """Files as given; directories expand to their files matching ``glob`` (recursively, sorted)."""
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob(glob) if f.is_file())
            if not found:
                raise ValueError(f"directory {item!r} has no files matching {glob!r}")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"input {item!r} does not exist")
    return out


def _default_corpus() -> list[str]:
    return [str(stdlib_root())]


def _is_merges_file(path: Path) -> bool:
    """A GPT-2 merges.txt as ``save_gpt2`` writes it (first line ``#version: ...``)."""
    return file_starts_with(path, b"#version:")


def _tokenizer_files(path: str) -> list[tuple[str, Path]]:
    """The tokenizer path as an input, and for a GPT-2 directory each file in it."""
    p = Path(path)
    files = [f for f in p.iterdir() if f.is_file()] if p.is_dir() else []
    return [("the --tokenizer", p)] + [("a file of the --tokenizer", f) for f in files]


def cmd_train(args: argparse.Namespace) -> int:
    paths = _expand(args.inputs or _default_corpus(), args.glob)
    out = Path(args.out)
    if args.format == "gpt2":
        outputs = [
            ("--out's vocab.json", out / "vocab.json"),
            ("--out's merges.txt", out / "merges.txt"),
        ]
        outputs.append(("--out", out))
        kinds = {
            "--out's vocab.json": ("a GPT-2 vocab.json", is_json_file),
            "--out's merges.txt": ("a GPT-2 merges.txt", _is_merges_file),
            # a model folder (weights, config) beside a vocab.json is not this command's to write into
            "--out": (
                "an empty folder or one holding only vocab.json and merges.txt",
                lambda p: (
                    own_folder(p) or (p.is_dir() and {f.name for f in p.iterdir()} <= GPT2_FILES)
                ),
            ),
        }
    else:
        outputs, kinds = [("--out", out)], {"--out": ("a tokenizer JSON file", is_json_file)}
    check_outputs(outputs, [("the input", p) for p in paths], kinds, force=args.force)
    specials = args.special_tokens
    total = sum(p.stat().st_size for p in paths)
    print(
        f"training on {len(paths)} file(s), {total / 1e6:.1f} MB, V={args.vocab_size}, specials={specials}"
    )
    t0 = time.perf_counter()
    # each file is its own document: pre-tokens (hence merges) never cross a file boundary
    vocab, merges = train_bpe(
        paths,
        args.vocab_size,
        specials,
        args.pattern,
        args.threads or available_cpus(),
        progress=True,
    )
    tok = Tokenizer(vocab, merges, specials, pattern=args.pattern)
    if args.format == "lmstack":
        formats.save(tok, out)
    elif args.format == "hf":
        formats.save_hf(tok, out)
    else:
        out.mkdir(parents=True, exist_ok=True)
        formats.save_gpt2(tok, out / "vocab.json", out / "merges.txt")
    print(f"{len(merges)} merges in {time.perf_counter() - t0:.2f}s -> {out} ({args.format})")
    if len(vocab) < args.vocab_size:
        print(
            f"note: V={len(vocab)} < --vocab-size {args.vocab_size}: every pre-token of this corpus is one token"
        )
    return 0


def cmd_encode(args: argparse.Namespace) -> int:
    paths = _expand(args.inputs or _default_corpus(), args.glob)
    side = str(args.out) + ".json"
    check_outputs(
        [("--out", args.out), ("the sidecar of --out", side)],
        [("the input", p) for p in paths] + _tokenizer_files(args.tokenizer),
        {
            "--out": ("a token file (one with a .json sidecar naming its dtype)", is_token_file),
            "the sidecar of --out": ("a token-file sidecar (a JSON object)", is_json_file),
        },
        force=args.force,
    )
    tok = formats.load_tokenizer(args.tokenizer)
    stats = encode_files(
        tok, paths, args.out, num_workers=args.threads or available_cpus(), progress=True
    )
    print(
        f"{stats.n_tokens} tokens ({stats.dtype}) from {stats.n_bytes / 1e6:.2f} MB in {len(paths)} file(s): "
        f"{stats.bytes_per_token:.3f} bytes/token, {stats.mb_per_s:.2f} MB/s -> {args.out}"
    )
    print(f"read with: np.memmap({str(args.out)!r}, dtype=np.{stats.dtype}, mode='r')")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    tok = formats.load_tokenizer(args.tokenizer)
    name = next((k for k, v in PATTERNS.items() if v == tok.pattern), "custom")
    print(f"tokenizer     {args.tokenizer}")
    print(f"vocab size V  {tok.vocab_size}")
    print(f"merges        {len(tok.merges)}")
    print(f"pattern       {name}: {tok.pattern}")
    print(
        f"special       {len(tok.special_tokens)}: {', '.join(list(tok.special_tokens)[:8])}"
        f"{' ...' if len(tok.special_tokens) > 8 else ''}"
    )
    print(f"bos/eos/pad   {tok.bos_token_id} / {tok.eos_token_id} / {tok.pad_token_id}")
    print(f"chat template {'yes' if tok.chat_template else 'no'}")
    print(f"encoder       {tok.backend}")
    if tok.missing_bytes:
        print(f"missing bytes {len(tok.missing_bytes)} (text containing them does not round-trip)")
    text = args.text if args.text is not None else "Hello, world! 你好 123"
    ids = tok.encode(text)
    print(f"encode({text!r}) -> {ids}")
    print(f"pieces        {[tok.vocab[i].decode('utf-8', errors='replace') for i in ids]}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("tokenizer", help="byte-level BPE: train, encode datasets, inspect")
    sub = p.add_subparsers(title="tokenizer commands", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda a: (p.print_help(), 0)[1])

    t = sub.add_parser(
        "train", help="train byte-level BPE on files or directories (default: Python's stdlib)"
    )
    t.add_argument(
        "inputs", nargs="*", help="text files or directories (default: the stdlib sources)"
    )
    t.add_argument(
        "--vocab-size", type=int, default=10_000, help="V, including specials and 256 bytes"
    )
    t.add_argument(
        "--special-tokens", nargs="*", default=["<|endoftext|>"], help="default: <|endoftext|>"
    )
    t.add_argument("--pattern", default="gpt2", help="gpt2 | gpt4 | llama3 | smollm | a regex")
    t.add_argument("--glob", default="*.py", help="files to take from directories (default *.py)")
    add_threads_argument(
        t,
        "--workers",
        help="processes for pre-token counting (default: the CPUs available "
        "to this process: affinity and cgroup quota)",
    )
    t.add_argument(
        "--format",
        choices=["lmstack", "hf", "gpt2"],
        default="lmstack",
        help="lmstack JSON, HF tokenizer.json, or a GPT-2 directory (vocab.json + merges.txt)",
    )
    t.add_argument("--out", required=True, help="output file (directory for --format gpt2)")
    t.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --out that is not a tokenizer file",
    )
    t.set_defaults(func=cmd_train)

    e = sub.add_parser(
        "encode", help="encode files into a flat uint16/uint32 token file for np.memmap"
    )
    e.add_argument(
        "inputs", nargs="*", help="text files or directories (default: the stdlib sources)"
    )
    e.add_argument(
        "--tokenizer", required=True, help="lmstack JSON, tokenizer.json, GPT-2 directory or GGUF"
    )
    e.add_argument(
        "--out", required=True, help="output token file (a .json sidecar is written beside it)"
    )
    e.add_argument(
        "--force", action="store_true", help="replace an existing --out that is not a token file"
    )
    e.add_argument("--glob", default="*.py", help="files to take from directories (default *.py)")
    add_threads_argument(
        e,
        "--workers",
        help="encoding processes (default: the CPUs available to this "
        "process: affinity and cgroup quota)",
    )
    e.set_defaults(func=cmd_encode)

    i = sub.add_parser("info", help="describe a tokenizer file and encode a sample")
    i.add_argument("tokenizer", help="lmstack JSON, tokenizer.json, GPT-2 directory or GGUF")
    i.add_argument("--text", default=None, help="text to encode as a sample")
    i.set_defaults(func=cmd_info)
