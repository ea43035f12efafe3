"""Evaluation throughput on SmolLM2-135M (fp32): lmstack vs HF transformers / lm-eval's ``hf`` class.

    python benchmarks/eval.py [--threads 2] [--ppl-tokens 4096] [--max-length 1024] [--stride 512]
        [--mc-items 48] [--batch-size 8] [--repeats 3]

1. Perplexity: the same tokens of ``data/eval/stdlib_heldout.txt``, context and stride. lmstack's
   ``eval.perplexity`` (windows batched, the ``onednn`` causal attention backend of ``kernels.onednn_attention``, logits and an in-place
   logsumexp a chunk of scored positions at a time) vs the transformers guide's loop
   (one window a forward, ``labels`` with -100). Both perplexities are printed (they must agree).
2. Multiple choice: the (context, option) requests of the first ``--mc-items`` items of
   ``data/eval/stdlib_docstring_mc``: lmstack's ``Evaluator.loglikelihood`` vs lm-eval's ``HFLM.loglikelihood``
   (``batch_size`` as given) on the same model weights; the largest log-likelihood difference is printed.

Both sides load the same GGUF (lmstack's loader; transformers' ``gguf_file``) and run with ``--threads``
torch threads. The machine is shared and noisy, so the two sides alternate ``--repeats`` times (after one
untimed warm-up each): each repetition's ratio is printed, then the median, min and max of the ratios.

``--contamination-demo MODEL_DIR`` runs instead the exchangeability test's demonstration (issue: "fine-tune the
small demo model on one task's test items in canonical order"): the first ``--demo-items`` docstring items, the
untouched model's permutation and sharded p-values, then a copy fine-tuned on those items concatenated in file
order (AdamW, ``--demo-steps`` steps) tested the same way:

    python benchmarks/eval.py --contamination-demo runs/demo/run/model --threads 2
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA = Path(__file__).resolve().parents[1] / "data" / "eval"


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def alternate(ours, peer, work: float, repeats: int, label: str, unit: str):
    """Warm both up, then time them in turn ``repeats`` times; print each pair and the ratio summary.
    Returns (our outputs, peer outputs) of the last run."""
    ours()
    peer()
    ratios = []
    for i in range(repeats):
        t_l, out_l = timed(ours)
        t_h, out_h = timed(peer)
        ratios.append(t_h / t_l)
        print(
            f"  [{i + 1}/{repeats}] lmstack {work / t_l:8.1f} {unit}   {label} {work / t_h:8.1f} {unit}   "
            f"ratio {t_h / t_l:.2f}x",
            flush=True,
        )
    r = sorted(ratios)
    print(
        f"  ratio over {repeats} repetitions: median {r[len(r) // 2]:.2f}x (min {r[0]:.2f}x, max {r[-1]:.2f}x)"
    )
    return out_l, out_h


@torch.no_grad()
def hf_guide_ppl(hf, ids, max_length, stride):
    """The transformers perplexity guide's loop (exact NLL count per window)."""
    x = torch.tensor([ids])
    nll, n, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        trg_len = end - prev_end
        inp = x[:, begin:end]
        target = inp.clone()
        target[:, :-trg_len] = -100
        k = int((target[:, 1:] != -100).sum())
        nll += float(hf(inp, labels=target).loss) * k
        n += k
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll / n), n


def contamination_demo(args) -> None:
    import copy

    import torch.nn.functional as F

    from lmstack.eval.contamination import permutation_test, sharded_test
    from lmstack.eval.tasks import load_task
    from lmstack.inference.loader import load_for_inference

    model, tok = load_for_inference(args.contamination_demo, None, "fp32")
    task = load_task(DATA / "stdlib_docstring_mc.yaml")
    items = task.items[: args.demo_items]
    examples = [tok.encode(it.context + task.target_delimiter + it.target() + "\n") for it in items]
    canon = sum(examples, [])
    L = model.config.max_seq_len
    print(
        f"{args.contamination_demo}: {len(examples)} items of {task.name} ({len(canon)} tokens, context {L})"
    )

    def report(m, label):
        r = permutation_test(m, examples, n_permutations=99, seed=0, progress=True)
        p_sh, diffs = sharded_test(
            m, examples, n_shards=args.demo_shards, n_permutations=10, seed=0
        )
        print(
            f"  {label}: canonical loglik {r.canonical_loglik:.1f} vs permuted mean "
            f"{sum(r.permuted_logliks) / len(r.permuted_logliks):.1f}; permutation p = {r.p_value:.3f}; "
            f"sharded ({args.demo_shards} shards) p = {p_sh:.2e}"
        )

    model.eval()
    report(model, "untouched")
    tuned = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(tuned.parameters(), lr=args.demo_lr, weight_decay=0.0)
    x = torch.tensor(canon)
    t0 = time.perf_counter()
    for _step in range(args.demo_steps):  # the test items, in file order, windows of the context
        loss = 0.0
        for b in range(0, len(canon) - 1, L):
            w = x[b : b + L + 1]
            out = tuned(w[None, :-1])[0]
            loss = loss + F.cross_entropy(out, w[1:], reduction="sum")
        loss = loss / (len(canon) - 1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(
        f"  fine-tuned {args.demo_steps} steps on the canonical order (lr {args.demo_lr}, final loss "
        f"{loss.item():.3f} nats/token, {time.perf_counter() - t0:.0f} s)"
    )
    report(tuned.eval(), "fine-tuned")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--mc-items", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=8, help="lm-eval hf batch_size")
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed repetitions of each side, alternating"
    )
    ap.add_argument(
        "--contamination-demo",
        default=None,
        metavar="MODEL_DIR",
        help="run the exchangeability demonstration on this (demo) model instead",
    )
    ap.add_argument("--demo-items", type=int, default=64)
    ap.add_argument("--demo-shards", type=int, default=8)
    ap.add_argument("--demo-steps", type=int, default=30)
    ap.add_argument("--demo-lr", type=float, default=1e-3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.contamination_demo:
        contamination_demo(args)
        return

    import transformers

    from lmstack.eval.perplexity import perplexity, read_eval_tokens, windows
    from lmstack.eval.runner import Evaluator
    from lmstack.eval.tasks import load_task
    from lmstack.inference.loader import load_for_inference
    from lmstack.model.io import find_named_model

    path = find_named_model("smollm2-135m")
    model, tok = load_for_inference("smollm2-135m", dtype="fp32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    print(
        f"SmolLM2-135M fp32 ({path.name} dequantised), {args.threads} threads, torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )

    ids = read_eval_tokens(DATA / "stdlib_heldout.txt", tok, max_tokens=args.ppl_tokens).tolist()
    n_scored = sum(e - b - s for b, e, s in windows(len(ids), args.max_length, args.stride))
    print(
        f"\nperplexity, {len(ids)} tokens, max_length {args.max_length}, stride {args.stride} "
        f"({n_scored} scored tokens a pass)"
    )
    r, (ppl_h, n_h) = alternate(
        lambda: perplexity(model, ids, args.max_length, args.stride, tokenizer=tok, progress=False),
        lambda: hf_guide_ppl(hf, ids, args.max_length, args.stride),
        n_scored,
        args.repeats,
        "HF transformers",
        "tokens/s",
    )
    print(
        f"  perplexity: lmstack {r.perplexity:.6f} ({r.n_tokens} tokens), HF {ppl_h:.6f} ({n_h} tokens)"
    )

    task = load_task(DATA / "stdlib_docstring_mc.yaml")
    pairs = [
        (p, task.target_delimiter + c)
        for it, p in zip(task.items[: args.mc_items], task.prompts())
        for c in it.choices
    ]
    ev = Evaluator(model, tok)

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hflm = HFLM(pretrained=hf, tokenizer=hf_tok, batch_size=args.batch_size, device="cpu")
    reqs = [Instance("loglikelihood", {}, pr, i) for i, pr in enumerate(pairs)]
    print(f"\nmultiple choice, {args.mc_items} items = {len(pairs)} loglikelihood requests")
    ll_l, ll_h = alternate(
        lambda: ev.loglikelihood(pairs),
        lambda: hflm.loglikelihood(reqs, disable_tqdm=True),
        len(pairs),
        args.repeats,
        f"lm-eval hf (batch {args.batch_size})",
        "requests/s",
    )
    diff = max(abs(a[0] - b[0]) for a, b in zip(ll_l, ll_h))
    print(
        f"  max |loglik difference| {diff:.2e}; same greedy flags: {[a[1] for a in ll_l] == [b[1] for b in ll_h]}"
    )


if __name__ == "__main__":
    main()
