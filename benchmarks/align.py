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
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from lmstack.align.data import encode_prompt
from lmstack.align.grpo import GRPOConfig, GRPOTrainer
from lmstack.align.tasks import get_task
from lmstack.inference import LLM, SamplingParams
from lmstack.inference.loader import load_for_inference
from lmstack.model.io import find_named_model
from lmstack.threads import add_threads_argument, set_threads


def run_lmstack(model, tok, prompts, G, L):
    """(wall s, CPU s, tokens) of one ``LLM.generate`` over the P·G requests (a fresh engine, warmed up)."""
    llm = LLM(model, tok, max_num_seqs=len(prompts) * G, max_num_batched_tokens=1024)
    params = [
        SamplingParams(temperature=1.0, max_tokens=L, ignore_eos=True, seed=k)
        for k in range(len(prompts) * G)
    ]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p in prompts for _ in range(G)], params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, sum(len(o.token_ids) for o in outs)


def load_hf():
    import transformers

    path = find_named_model("smollm2-135m")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


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
    add_threads_argument(ap)
    args = ap.parse_args()
    set_threads(args.threads)
    print(
        f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"capability {torch.backends.cpu.get_cpu_capability()}"
    )
    model, tok = load_for_inference("smollm2-135m")
    task = get_task("arithmetic", digits=2)
    prompts = [encode_prompt(tok, p.prompt) for p in task.generate(args.prompts, seed=1)]
    P, G, L = args.prompts, args.generations, args.max_new_tokens
    print(
        f"rollout: P={P} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens) x G={G}, {L} new tokens"
    )
    hf = None if args.skip_hf else load_hf()
    runs: dict[str, list[tuple[float, float, int]]] = {"lmstack engine": [], "HF generate": []}
    for _ in range(args.repeat):
        runs["lmstack engine"].append(run_lmstack(model, tok, prompts, G, L))
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
        )
        trainer = GRPOTrainer(cfg, model, tok, progress=False)
        print(f"GRPO step (P={P}, G={G}, L_max={L}, micro-batch 16, mu=1):")
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
