"""GRPO rollouts on SmolLM2-135M: lmstack's engine vs HF ``generate`` (what TRL uses without vLLM), and the
seconds of one GRPO step split into generation / log-probs / training (docs/align.md).

    python benchmarks/align.py [--prompts 8] [--generations 8] [--max-new-tokens 32] [--threads 2]

Rollout workload: ``--prompts`` arithmetic prompts through the chat template, ``--generations`` samples each at
temperature 1, exactly ``--max-new-tokens`` tokens per sample (EOS ignored on both sides, so both produce the
same number of tokens). lmstack: one ``LLM.generate`` over the P·G requests (continuous batching, paged KV,
the prefix cache sharing each prompt among its G samples). HF: ``generate(num_return_sequences=G,
do_sample=True)`` on the P left-padded prompts as one batch, as TRL's GRPOTrainer calls it. Then
``--grpo-steps`` GRPO steps with GRPOTrainer report the time split.

``--repeat N`` runs the two rollouts N times, interleaved (lmstack, HF, lmstack, ...), and reports each side's
fastest run by wall time and by the process's CPU time (``time.process_time``: on a machine shared with other
jobs, time spent waiting for a core is not counted, so with ``--threads 1`` it is the work done).

Other shapes: ``--prompt-tokens N`` lengthens each prompt to at least N tokens with worked examples of the task
(few-shot, different problems for each prompt, so only a group's G samples share a prefix); ``--dtype bf16``
runs HF in bf16 (its weights cast); ``--engine-dtype bf16`` runs the engine's GEMMs in bf16 on its fp32 weights,
as ``GRPOConfig(rollout_dtype="bf16")`` does (``ops.gemm.inference_dtype``), and the GRPO steps with it. ``--compile on`` compiles the engine's decode step with ``--compiled-rows`` as its
largest compiled batch (``DecodeStep.max_compiled_batch``; engine default 8, larger batches run eagerly).
``--profile-steps K`` profiles K decode-only engine steps over the P·G rows (torch.profiler, top ops).
The script also prints the token rows each side runs through the model: HF prefills every sample's copy of
its prompt (P·G·S + P·G·L rows), the engine each prompt once (P·S + P·G·L, the prefix cache), whose ratio
bounds what the engine can gain when both sides' per-row cost is the same GEMMs.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from contextlib import nullcontext

import torch

from lmstack.align.data import encode_prompt
from lmstack.align.grpo import GRPOConfig, GRPOTrainer
from lmstack.align.tasks import get_task
from lmstack.inference import LLM, SamplingParams
from lmstack.inference.loader import load_for_inference
from lmstack.model.io import find_named_model
from lmstack.ops.gemm import inference_dtype
from lmstack.threads import add_threads_argument, set_threads


def make_llm(model, tok, n: int, compile: str = "off", compiled_rows: int = 8) -> LLM:
    """The rollout engine as ``GRPOTrainer`` builds it (eager decode step unless ``compile='on'``)."""
    llm = LLM(model, tok, max_num_seqs=n, max_num_batched_tokens=1024, compile=compile)
    decode = llm.engine.runner.decode
    if decode is not None and decode.compiled:
        decode.max_compiled_batch = compiled_rows
        llm.engine.warm_up([n])  # compile the P·G-row bucket before the timing
    return llm


def run_lmstack(model, tok, prompts, G, L, compile="off", compiled_rows=8, bf16=False):
    """(wall s, CPU s, tokens) of one ``LLM.generate`` over the P·G requests (a fresh engine, warmed up);
    ``bf16``: its GEMMs in bf16 on packed bf16 copies of the fp32 weights (made in the warm-up)."""
    with inference_dtype(torch.bfloat16) if bf16 else nullcontext():
        return _run_lmstack(model, tok, prompts, G, L, compile, compiled_rows)


def _run_lmstack(model, tok, prompts, G, L, compile, compiled_rows):
    llm = make_llm(model, tok, len(prompts) * G, compile, compiled_rows)
    params = [
        SamplingParams(temperature=1.0, max_tokens=L, ignore_eos=True, seed=k)
        for k in range(len(prompts) * G)
    ]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p in prompts for _ in range(G)], params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, sum(len(o.token_ids) for o in outs)


def load_hf(dtype: torch.dtype = torch.float32):
    import transformers

    path = find_named_model("smollm2-135m")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    ).eval()


def task_prompts(tok, task, P: int, min_tokens: int = 0) -> list[list[int]]:
    """P task prompts through the chat template; with ``min_tokens``, each user turn starts with worked
    examples (problems of another seed, with their answers) until the prompt has at least that many tokens."""
    problems = task.generate(P, seed=1)
    shots = iter(task.generate(P * 64, seed=2))
    out = []
    for p in problems:
        text = p.prompt
        while len(ids := encode_prompt(tok, text)) < min_tokens:
            s = next(shots)
            text = f"{s.prompt}\n{task.solution(s)}\n\n" + text
        out.append(ids)
    return out


def profile_steps(model, tok, prompts, G, steps, compile="off", compiled_rows=8) -> None:
    """torch.profiler over ``steps`` decode-only engine steps of the P·G rows (after their prefill)."""
    from torch.profiler import ProfilerActivity, profile

    llm = make_llm(model, tok, len(prompts) * G, compile, compiled_rows)
    eng = llm.engine
    for k, p in enumerate(p for p in prompts for _ in range(G)):
        params = SamplingParams(temperature=1.0, max_tokens=2 * steps + 8, ignore_eos=True, seed=k)
        eng.add_request(None, p, params)
    while not all(s.num_computed + 1 == len(s.all_ids) for s in eng.requests.values()):
        eng.step()  # prefill (chunks), until every row feeds one token
    eng.step()
    c0 = time.process_time()
    for _ in range(steps):
        eng.step()
    per_step = (time.process_time() - c0) / steps
    print(f"decode step, {len(eng.requests)} rows: {per_step * 1e3:.0f} ms CPU (unprofiled)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def run_hf(hf, prompts, G, L):
    """(wall s, CPU s, tokens) of one ``generate(num_return_sequences=G)`` over the P prompts."""
    S = max(map(len, prompts))
    ids = torch.tensor([[0] * (S - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (S - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    with torch.no_grad():
        hf.generate(
            ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False, pad_token_id=0
        )
        t0, c0 = time.perf_counter(), time.process_time()
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=L,
            min_new_tokens=L,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            num_return_sequences=G,
            pad_token_id=0,
        )
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, (out.shape[1] - S) * out.shape[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--grpo-steps", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved runs of each rollout")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="few-shot prompts of >= N tokens")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="HF's weights")
    ap.add_argument(
        "--engine-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="the engine's GEMMs (fp32 weights either way): GRPOConfig.rollout_dtype",
    )
    ap.add_argument("--compile", choices=("off", "on", "auto"), default="off")
    ap.add_argument("--compiled-rows", type=int, default=8, help="largest compiled decode batch")
    ap.add_argument("--profile-steps", type=int, default=0)
    add_threads_argument(ap)
    args = ap.parse_args()
    set_threads(args.threads)
    print(
        f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"capability {torch.backends.cpu.get_cpu_capability()}"
    )
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, tok = load_for_inference("smollm2-135m", dtype=torch.float32)
    bf16 = args.engine_dtype == "bf16"
    task = get_task("arithmetic", digits=2)
    prompts = task_prompts(tok, task, args.prompts, args.prompt_tokens)
    P, G, L = args.prompts, args.generations, args.max_new_tokens
    S = max(map(len, prompts))
    print(
        f"rollout: P={P} prompts ({min(map(len, prompts))}-{S} tokens) x G={G}, {L} new tokens, "
        f"engine {args.engine_dtype} GEMMs, HF {args.dtype}, engine compile={args.compile}"
        + (f" (up to {args.compiled_rows} rows)" if args.compile != "off" else "")
    )
    hf_rows, engine_rows = P * G * (S + L), sum(map(len, prompts)) + P * G * L
    print(
        f"token rows through the model: HF {hf_rows}, engine {engine_rows} "
        f"(ratio {hf_rows / engine_rows:.2f}: the bound at equal per-row cost)"
    )
    if args.profile_steps:
        with inference_dtype(torch.bfloat16) if bf16 else nullcontext():
            profile_steps(
                model, tok, prompts, G, args.profile_steps, args.compile, args.compiled_rows
            )
        return
    hf = None if args.skip_hf else load_hf(dtype)
    runs: dict[str, list[tuple[float, float, int]]] = {"lmstack engine": [], "HF generate": []}
    for _ in range(args.repeat):
        runs["lmstack engine"].append(
            run_lmstack(model, tok, prompts, G, L, args.compile, args.compiled_rows, bf16)
        )
        if hf is not None:
            runs["HF generate"].append(run_hf(hf, prompts, G, L))
    best = {}
    for name, rs in runs.items():
        if not rs:
            continue
        wall, cpu = min(r[0] for r in rs), min(r[1] for r in rs)
        n = rs[0][2]
        best[name] = (n / wall, n / cpu)
        print(
            f"  {name:16s} wall {wall:7.2f} s {n / wall:7.1f} tok/s   CPU {cpu:7.2f} s "
            f"{n / cpu:7.1f} tok/s   (best of {len(rs)})"
        )
    if len(best) == 2:
        (lw, lc), (hw, hc) = best["lmstack engine"], best["HF generate"]
        print(f"  lmstack / HF     wall {lw / hw:5.2f}x   CPU {lc / hc:5.2f}x")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.grpo_steps:
        cfg = GRPOConfig(
            task="arithmetic",
            task_args={"digits": 2},
            steps=args.grpo_steps,
            prompts_per_step=P,
            num_generations=G,
            max_new_tokens=L,
            lr=1e-6,
            eval_problems=1,
            train_problems=200,
            out_dir="runs/bench_align",
            micro_batch=16,
            rollout_dtype=args.engine_dtype,
        )
        trainer = GRPOTrainer(cfg, model, tok, progress=False)
        print(
            f"GRPO step (P={P}, G={G}, L_max={L}, micro-batch 16, mu=1, "
            f"rollout {args.engine_dtype}):"
        )
        for _ in range(args.grpo_steps):
            m = trainer.train_step()
            print(
                f"  step {m['step']}: generation {m['gen_s']:.2f}s ({m['gen_tokens_per_s']:.0f} tok/s), "
                f"old log-probs {m['logprob_s']:.2f}s, training {m['train_s']:.2f}s "
                f"({m['train_tokens_per_s']:.0f} tok/s), total {m['step_s']:.2f}s, "
                f"generation share {m['gen_s'] / m['step_s']:.0%}"
            )


if __name__ == "__main__":
    main()
