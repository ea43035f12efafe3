"""Run under ``torchrun --nproc_per_node=2``: SFT, DPO, GRPO and expert iteration data parallel on a tiny model,
and DPO's pair sampling; rank 0 writes each run's logged rows and final weights (and the sampled pairs) for
``test_align_distributed.py`` to compare with one process.

``python align_ddp_driver.py OUT`` (one process) writes the same files: the reference."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from align_helpers import byte_chat_tokenizer, tiny_model  # noqa: E402

from lmstack.align import distributed as D  # noqa: E402
from lmstack.align.data import encode_example  # noqa: E402
from lmstack.align.dpo import DPOTrainer, sample_pairs  # noqa: E402
from lmstack.align.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from lmstack.align.sft import SFTTrainer  # noqa: E402
from lmstack.align.tasks import get_task  # noqa: E402
from lmstack.train.config import TrainConfig  # noqa: E402

QA = [("2+3", "5"), ("7*6", "42"), ("9-4", "5"), ("8+8", "16"), ("1+1", "2"), ("3*3", "9")]
GRPO_RUNS = {  # (loss_type, advantage): sequence means with group std; token mean with batch std
    "grpo_group": dict(loss_type="grpo", advantage="group"),
    "dapo_batch": dict(loss_type="dapo", advantage="batch"),
    "expert_iteration": dict(algorithm="expert_iteration"),
}


def a_rate(problem, completion):
    """A reward a random tiny model can climb: the fraction of 'a' characters in the completion."""
    return completion.count("a") / max(len(completion), 1)


def even_length(problem, completion):
    """A verifier about half the samples of a random tiny model pass: an even number of characters."""
    return float(len(completion) % 2 == 0)


def train_config(out: Path, batch_size: int) -> TrainConfig:
    return TrainConfig(
        train_data="task",
        out_dir=str(out),
        batch_size=batch_size,
        seq_len=64,
        lr=1e-2,
        min_lr=1e-2,
        warmup_steps=0,
        max_steps=3,
        optimizer="sgd",  # the update is linear in the gradient: equal weights = equal gradients
        momentum=0.0,
        weight_decay=0.0,
        grad_clip=0.0,
        precision="fp32",
        eval_interval=0,
        log_interval=1,
        device="cpu",
        seed=0,
    )


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main(out: Path, world: int) -> None:
    torch.set_num_threads(1)
    tok = byte_chat_tokenizer()
    exs = [encode_example(tok, q, a) for q, a in QA[:4]]
    B = 4 // world  # the global batch is 4 on every run
    sft = SFTTrainer(
        train_config(out / "sft", B), tiny_model(), exs, exs[:3], tokenizer=tok, progress=False
    )
    sft.fit()
    pairs = [(encode_example(tok, q, a), encode_example(tok, q, a + "0")) for q, a in QA]
    dpo = DPOTrainer(
        train_config(out / "dpo", B),
        tiny_model(),
        pairs[:4],
        pairs[4:],
        tokenizer=tok,
        beta=0.5,
        pad_id=tok.pad_token_id,
        progress=False,
    )
    dpo.fit()
    results = {"sft": sft, "dpo": dpo}
    for name, kw in GRPO_RUNS.items():
        cfg = GRPOConfig(
            steps=2,
            prompts_per_step=4,
            num_generations=4,
            max_new_tokens=6,
            lr=1e-2,
            chat=False,
            stop=(),
            eval_problems=3,
            train_problems=16,
            out_dir=str(out / name),
            epochs=2,
            micro_batch=4,  # several micro-batches per rank: no_sync until the last
            seed=0,
            **kw,
        )
        model = tiny_model(vocab_size=259, max_seq_len=128)
        if name == "expert_iteration":
            # rank 0's two prompts keep their even-length samples at step 1, rank 1's none (a rank with
            # nothing verified still joins the all-reduce); at step 2 every prompt does
            g = GRPOTrainer(cfg, model, tok, progress=False, reward_fns={})
            first = {g.train_set[i].prompt for i in g.step_problems(0)[:2]}

            def verified(problem, completion, g=g, first=first):
                if g.step == 0 and problem.prompt not in first:
                    return 0.0
                return even_length(problem, completion)

            g.reward_fns = {"correct": verified}
        else:
            g = GRPOTrainer(cfg, model, tok, progress=False, reward_fns={"a": a_rate})
        g.fit()
        results[name] = g
    # DPO pairs from the model's own samples: 5 problems over 2 ranks (2 + 3), gathered on every rank
    task = get_task("arithmetic", digits=1)
    seen = set()  # the problems this rank verified: its share only, not all five

    def counted(problem, completion):
        seen.add(problem.prompt)
        return even_length(problem, completion)

    pairs_rows = sample_pairs(
        tiny_model(vocab_size=259, max_seq_len=128),
        tok,
        task,
        task.generate(5, 0),
        num_generations=4,
        max_new_tokens=6,
        chat=False,
        stop=(),
        verify=counted,
    )
    shares = D.gather_objects(len(seen))
    if sft.is_main:
        for name, t in results.items():
            model = t.raw_model if hasattr(t, "raw_model") else t.model
            state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
            save_file(state, str(out / f"{name}.safetensors"))
            metrics = Path(t.metrics_path)
            (out / f"{name}.json").write_text(json.dumps(rows(metrics)))
        (out / "pairs.json").write_text(json.dumps({"pairs": pairs_rows, "shares": shares}))


if __name__ == "__main__":
    import os

    main(Path(sys.argv[1]), int(os.environ.get("WORLD_SIZE", "1")))
