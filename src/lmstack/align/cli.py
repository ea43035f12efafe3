"""``lmstack sft | dpo | grpo``: post-training from an lmstack, HF or GGUF checkpoint (or a name such as
``smollm2-135m``); each writes ``<out>/metrics.jsonl``, a PNG and ``<out>/model`` (weights + tokenizer with its
chat template), which ``lmstack generate/chat/serve --model <out>/model`` load. docs/align.md.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from lmstack.cpu import TRAIN_PRECISIONS
from lmstack.inference.loader import add_model_arguments
from lmstack.threads import add_threads_argument
from lmstack.utils import atomic_write_text, check_outputs, own_folder_kind


def _common(p: argparse.ArgumentParser, out: str) -> None:
    add_model_arguments(p, model_help="a name, .gguf file or checkpoint directory", dtype=None)
    p.add_argument("--out", default=out, help=f"run folder (default {out})")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps (grpo: rollout steps)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-chat", action="store_true", help="plain prompts instead of the chat template"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in --out")
    p.add_argument(
        "--force",
        action="store_true",
        help="write into --out even when it holds something else (another model, another run)",
    )
    add_threads_argument(p)


def _precision(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--precision",
        default="fp32",
        choices=list(TRAIN_PRECISIONS),
        help="bf16/fp16 autocast for training; auto: bf16 where this CPU multiplies it natively and faster",
    )


def _trainer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch-size", type=int, default=8, help="examples (dpo: pairs) per micro-batch"
    )
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument(
        "--seq-len", type=int, default=256, help="longest example (prompt + response) in tokens"
    )
    _precision(p)
    p.add_argument("--ckpt-interval", type=int, default=0)
    p.add_argument("--eval-interval", type=int, default=0)
    p.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its last checkpoint"
    )


def register(subparsers) -> None:
    s = subparsers.add_parser(
        "sft", help="supervised fine-tuning on prompt/response JSONL or a task's solutions"
    )
    _common(s, "runs/sft")
    _trainer_args(s)
    s.add_argument("--data", help="JSONL rows {prompt, response}")
    s.add_argument("--val", help="validation JSONL (default: none; the loss on training examples)")
    s.add_argument(
        "--task",
        help="instead of --data: worked solutions of a verifiable task (lmstack.align.tasks)",
    )
    s.add_argument(
        "--task-args",
        default="{}",
        help="JSON keyword arguments of the task, e.g. '{\"digits\": 1}'",
    )
    s.add_argument("--examples", type=int, default=256, help="--task: training examples")
    s.add_argument(
        "--packing", action="store_true", help="pack examples into rows (per-document attention)"
    )
    s.add_argument("--normalize", default="token", choices=["token", "sequence"])
    s.set_defaults(func=cmd_sft)

    d = subparsers.add_parser(
        "dpo", help="direct preference optimisation on (prompt, chosen, rejected) pairs"
    )
    _common(d, "runs/dpo")
    _trainer_args(d)
    d.add_argument("--data", help="JSONL rows {prompt, chosen, rejected}")
    d.add_argument(
        "--task", help="instead of --data: pairs from the model's own verified/failed samples"
    )
    d.add_argument("--task-args", default="{}", help="JSON keyword arguments of the task")
    d.add_argument("--prompts", type=int, default=128, help="--task: problems sampled for pairs")
    d.add_argument(
        "--val-prompts",
        type=int,
        default=0,
        help="--task: held-out problems sampled for validation pairs",
    )
    d.add_argument("--generations", type=int, default=8, help="--task: samples per problem")
    d.add_argument("--beta", type=float, default=0.1)
    d.add_argument("--loss-type", default="sigmoid", choices=["sigmoid", "ipo", "robust", "hinge"])
    d.add_argument("--label-smoothing", type=float, default=0.0)
    d.add_argument(
        "--reference",
        default="precomputed",
        choices=["precomputed", "model"],
        help="precomputed reference log-probs (one model in memory) or a frozen copy",
    )
    d.set_defaults(func=cmd_dpo)

    g = subparsers.add_parser(
        "grpo", help="RL with verifiable rewards: GRPO (or expert iteration) on a task"
    )
    _common(g, "runs/grpo")
    g.add_argument("--task", default="arithmetic", help="arithmetic | countdown | strings | format")
    g.add_argument(
        "--task-args",
        default="{}",
        help="JSON keyword arguments of the task, e.g. '{\"digits\": 1}'",
    )
    g.add_argument("--algorithm", default="grpo", choices=["grpo", "expert_iteration"])
    g.add_argument("--rewards", default="correct,format", help="comma-separated reward functions")
    g.add_argument(
        "--reward-weights", default="{}", help="JSON weights by name, e.g. '{\"format\": 0.2}'"
    )
    g.add_argument("--prompts-per-step", type=int, default=8)
    g.add_argument("--generations", type=int, default=8, help="G samples per prompt")
    g.add_argument("--max-new-tokens", type=int, default=48)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--epochs", type=int, default=1, help="μ optimizer steps per rollout batch")
    g.add_argument("--micro-batch", type=int, default=16)
    g.add_argument("--loss-type", default="grpo", choices=["grpo", "bnpo", "dapo", "dr_grpo"])
    g.add_argument("--advantage", default="group", choices=["group", "batch", "none", "rloo"])
    g.add_argument("--eps-low", type=float, default=0.2)
    g.add_argument("--eps-high", type=float, default=None)
    g.add_argument(
        "--beta", type=float, default=0.0, help="k3 KL coefficient (> 0 keeps a frozen reference)"
    )
    g.add_argument("--mask-truncated", action="store_true")
    _precision(g)
    g.add_argument(
        "--rollout-dtype",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="GEMMs of the engine's training rollouts: bf16 on a packed bf16 copy of the fp32 weights "
        "(the learner and its log-probs stay fp32); auto: bf16 where this CPU multiplies it natively and faster",
    )
    g.add_argument("--eval-problems", type=int, default=64)
    g.add_argument("--eval-every", type=int, default=0)
    g.add_argument("--ckpt-interval", type=int, default=0)
    g.add_argument("--resume", action="store_true")
    g.add_argument(
        "--eval-only", action="store_true", help="print the held-out greedy accuracy and exit"
    )
    g.set_defaults(func=cmd_grpo)


def _json(text: str, flag: str) -> dict:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {text!r} is not JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{flag} {text!r} must be a JSON object")
    return d


MARKER = "align.json"  # written into --out first: the folder is an lmstack sft/dpo/grpo run


def _own_out(args) -> None:
    """Refuse an --out folder of another model or run (absent, empty or an earlier alignment run only;
    --force overrides), before anything loads; then mark it as this command's. Under torchrun rank 0 does
    it (the other ranks would see its half-written marker)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    command = args.func.__name__.removeprefix("cmd_")
    inputs = [("--model", args.model), ("--tokenizer", args.tokenizer)]
    inputs += [(f"--{k}", getattr(args, k, None)) for k in ("data", "val")]
    check_outputs(
        [("--out", args.out)],
        [(label, p) for label, p in inputs if p and Path(p).exists()],
        {"--out": own_folder_kind(command, MARKER)},
        force=args.force,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).exists():
        atomic_write_text(
            out / MARKER, json.dumps({"command": command, "model": args.model}) + "\n"
        )


def _load(args):
    from lmstack.inference.loader import load_for_inference

    _own_out(args)
    model, tok = load_for_inference(args.model, args.tokenizer)
    if tok is None:
        raise ValueError(f"--model {args.model}: no tokenizer found; pass --tokenizer")
    return model, tok


def _train_config(args, **extra):
    from lmstack.train.config import TrainConfig

    return TrainConfig(
        train_data=str(getattr(args, "data", None) or "task"),
        out_dir=args.out,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        seq_len=args.seq_len,
        lr=args.lr,
        min_lr=args.lr / 10,
        warmup_steps=min(10, args.steps // 10),
        max_steps=args.steps,
        weight_decay=0.0,
        precision=args.precision,
        device="cpu",
        seed=args.seed,
        ckpt_interval=args.ckpt_interval,
        eval_interval=args.eval_interval,
        log_interval=1,
        fused_loss=False,
        **extra,
    )


def _finish(trainer, summary: dict) -> int:
    path = trainer.export()
    trainer.plot()
    summary = {k: v for k, v in summary.items() if k != "last_train"} | {"model": str(path)}
    if trainer.is_main:
        print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_sft(args) -> int:
    from lmstack.align.data import encode_example, read_sft
    from lmstack.align.sft import SFTTrainer
    from lmstack.align.tasks import get_task

    model, tok = _load(args)
    if bool(args.data) == bool(args.task):
        raise ValueError("pass exactly one of --data (JSONL) or --task (a task's worked solutions)")
    if args.data:
        rows = [(r["prompt"], r["response"]) for r in read_sft(args.data)]
    else:
        task = get_task(args.task, **_json(args.task_args, "--task-args"))
        rows = [(p.prompt, task.solution(p)) for p in task.generate(args.examples, args.seed)]
    chat, max_len = not args.no_chat, args.seq_len + 1
    train = [encode_example(tok, p, r, chat=chat, max_len=max_len) for p, r in rows]
    val = (
        [
            encode_example(tok, r["prompt"], r["response"], chat=chat, max_len=max_len)
            for r in read_sft(args.val)
        ]
        if args.val
        else []
    )
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    trainer = SFTTrainer(
        _train_config(args, packing=args.packing, sep_id=0 if args.packing else None),
        model,
        train,
        val,
        tokenizer=tok,
        normalize=args.normalize,
        pad_id=pad,
        overwrite=args.overwrite,
    )
    if args.resume:
        trainer.resume()
    return _finish(trainer, trainer.fit())


def cmd_dpo(args) -> int:
    from lmstack.align.data import encode_example, read_preferences, write_jsonl
    from lmstack.align.dpo import DPOTrainer, sample_pairs
    from lmstack.align.tasks import get_task

    model, tok = _load(args)
    if bool(args.data) == bool(args.task):
        raise ValueError(
            "pass exactly one of --data (JSONL pairs) or --task (pairs from the model's own samples)"
        )
    val_rows = []
    if args.data:
        rows = read_preferences(args.data)
    else:
        task = get_task(args.task, **_json(args.task_args, "--task-args"))

        def sample(problems):
            return sample_pairs(
                model, tok, task, problems, args.generations, seed=args.seed, chat=not args.no_chat
            )

        rows = sample(task.generate(args.prompts, args.seed))
        if not rows:
            raise ValueError(
                f"no problem of {args.prompts} had both a correct and an incorrect sample; "
                "raise --prompts or --generations"
            )
        val_rows = (
            sample(task.generate(args.val_prompts, args.seed, "test")) if args.val_prompts else []
        )
        if int(os.environ.get("RANK", "0")) == 0:  # every rank holds the same gathered pairs
            Path(args.out).mkdir(parents=True, exist_ok=True)
            write_jsonl(Path(args.out) / "pairs.jsonl", rows)
            if val_rows:
                write_jsonl(Path(args.out) / "val_pairs.jsonl", val_rows)
            print(
                f"{len(rows)} pairs from {args.prompts} problems, {len(val_rows)} held-out pairs from "
                f"{args.val_prompts} -> {args.out}"
            )
    chat, max_len = not args.no_chat, args.seq_len + 1

    def encode(rs):
        return [
            (
                encode_example(tok, r["prompt"], r["chosen"], chat=chat, max_len=max_len),
                encode_example(tok, r["prompt"], r["rejected"], chat=chat, max_len=max_len),
            )
            for r in rs
        ]

    pairs, val_pairs = encode(rows), encode(val_rows)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    trainer = DPOTrainer(
        _train_config(args),
        model,
        pairs,
        val_pairs,
        tokenizer=tok,
        beta=args.beta,
        loss_type=args.loss_type,
        label_smoothing=args.label_smoothing,
        reference=args.reference,
        pad_id=pad,
        overwrite=args.overwrite,
    )
    if args.resume:
        trainer.resume()
    else:
        before = trainer.evaluate()  # every rank scores its share
        if trainer.is_main:
            print("before training:", json.dumps(before))
    return _finish(trainer, trainer.fit())


def cmd_grpo(args) -> int:
    from lmstack.align.grpo import GRPOConfig, GRPOTrainer
    from lmstack.align.sft import save_model_dir

    model, tok = _load(args)
    task_args, weights = (
        _json(args.task_args, "--task-args"),
        _json(args.reward_weights, "--reward-weights"),
    )
    config = GRPOConfig(
        task=args.task,
        task_args=task_args,
        rewards=tuple(args.rewards.split(",")),
        reward_weights=weights,
        algorithm=args.algorithm,
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        num_generations=args.generations,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        epochs=args.epochs,
        micro_batch=args.micro_batch,
        lr=args.lr,
        loss_type=args.loss_type,
        advantage=args.advantage,
        eps_low=args.eps_low,
        eps_high=args.eps_high,
        beta=args.beta,
        mask_truncated=args.mask_truncated,
        chat=not args.no_chat,
        eval_problems=args.eval_problems,
        eval_every=args.eval_every,
        seed=args.seed,
        precision=args.precision,
        rollout_dtype=args.rollout_dtype,
        out_dir=args.out,
        ckpt_interval=args.ckpt_interval,
    )
    trainer = GRPOTrainer(config, model, tok)
    if args.eval_only:
        ev = trainer.evaluate()
        if trainer.is_main:
            print(json.dumps({"model": args.model, "problems": args.eval_problems, **ev}))
        return 0
    if args.resume:
        trainer.resume()
    elif (Path(args.out) / "checkpoints").exists() and not args.overwrite:
        raise ValueError(
            f"{args.out} holds a previous run; pass --resume to continue it or --overwrite"
        )
    summary = trainer.fit()
    d = Path(args.out) / "model"
    if trainer.is_main:  # every replica holds the same weights
        save_model_dir(model, tok, d)
        print(json.dumps(summary | {"model": str(d)}, indent=2, default=str))
    return 0
