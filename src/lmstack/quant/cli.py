"""``lmstack compress``: width-prune a model by activation importance, distil it from the original, save it.

    lmstack compress --model smollm2-135m --d-ff 1024 --n-kv-heads 2 --distill-steps 50 --out smol-pruned
    lmstack compress --model runs/demo --d-ff 256 --out runs/demo-pruned

Calibration / distillation / evaluation text: ``--text FILE`` (default: the running Python's
standard-library sources, the demo's corpus); rows of ``--seq`` tokens, the last ``--eval-rows`` held
out for the before/after perplexity. Prints parameters, perplexity of the
original, the pruned and the distilled model, and writes an lmstack checkpoint (config.json +
model.safetensors) to ``--out``.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

from lmstack.model.io import load_model, save_pretrained
from lmstack.quant.prune import distill, prune_width
from lmstack.threads import add_threads_argument, set_threads
from lmstack.tokenizer import load_tokenizer
from lmstack.utils import check_outputs


def register(subparsers) -> None:
    p = subparsers.add_parser("compress", help="width pruning by activation importance + logit distillation",
                              description=__doc__.split("\n")[0] + " (seed 001 \"有损提速\"; Minitron).")
    p.add_argument("--model", required=True, help="smollm2-135m, a GGUF file or an lmstack checkpoint directory")
    p.add_argument("--out", required=True, help="directory for the pruned checkpoint")
    p.add_argument("--d-ff", type=int, default=None, help="FFN width F to keep (default: unchanged)")
    p.add_argument("--n-kv-heads", type=int, default=None, help="KV groups K to keep, with their query heads")
    p.add_argument("--d-model", type=int, default=None, help="embedding channels D to keep")
    p.add_argument("--text", default=None, help="calibration/distillation/eval text file (default: stdlib sources)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--calib-rows", type=int, default=16)
    p.add_argument("--eval-rows", type=int, default=4)
    p.add_argument("--distill-steps", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    add_threads_argument(p)
    p.set_defaults(func=run_compress)


def _text(path: str | None) -> str:
    if path:
        return Path(path).read_text(errors="ignore")
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "".join(f.read_text(errors="ignore") for f in sorted(lib.glob("*.py"))[:60])


@torch.no_grad()
def _ppl(model, rows) -> float:
    nll = sum(F.cross_entropy(model(r[None])[0, :-1].float(), r[1:], reduction="sum").item() for r in rows)
    return math.exp(nll / (rows.numel() - rows.shape[0]))


def run_compress(args: argparse.Namespace) -> int:
    check_outputs([("--out", args.out)], [("--model", args.model), ("--text", args.text)])
    set_threads(args.threads)
    lm = load_model(args.model)
    teacher = lm.model.eval()
    ids = load_tokenizer(lm.source).encode(_text(args.text))
    n = min(args.calib_rows + args.eval_rows, len(ids) // args.seq)
    if n <= args.eval_rows:
        raise ValueError(f"the text gives {len(ids)} tokens: fewer than {args.eval_rows + 1} rows of --seq {args.seq}")
    rows = torch.tensor(ids[: n * args.seq]).view(n, args.seq)
    calib, held = rows[:-args.eval_rows], rows[-args.eval_rows:]
    student = prune_width(teacher, calib, args.d_ff, args.n_kv_heads, args.d_model)
    before, pruned = _ppl(teacher, held), _ppl(student, held)
    after = pruned
    if args.distill_steps:
        distill(student, teacher, calib, args.distill_steps, args.lr, args.temperature)
        after = _ppl(student, held)
    p_t = sum(p.numel() for p in teacher.parameters())
    p_s = sum(p.numel() for p in student.parameters())
    print(f"parameters {p_t / 1e6:.1f}M -> {p_s / 1e6:.1f}M; "
          f"held-out perplexity {before:.2f} -> pruned {pruned:.2f} -> distilled ({args.distill_steps} steps) {after:.2f}")
    save_pretrained(student, args.out)
    print(f"wrote {args.out}/config.json and model.safetensors (tokenizer: the original model's)")
    return 0
