"""RL with verifiable rewards: GRPO (Shao et al. 2024, "DeepSeekMath") and expert iteration, with rollouts on
lmstack's continuous-batching engine in the same process as the learner.

One step (``GRPOTrainer.train_step``):

1. **rollout** — P prompts of the task, G samples each, from ``LLMEngine`` (``LLM.generate``) over the very
   model being trained (shared parameter tensors: no second copy for generation). Every sample has its own
   seed (run seed, step, index), so a run's rollouts are the same whatever the batch composition;
   stop strings end a completion at ``</answer>``.
2. **rewards** — ``rewards.score`` (weighted functions; a failing reward scores 0 and is counted), then
   advantages per group (``losses.group_advantages`` with std "group"/"batch"/"none", or RLOO).
3. **old / reference log-probs** — one no-grad pass over the rollout batch with the current weights
   (π_old) and, with β > 0, with the frozen reference (π_ref).
4. **optimise** — μ epochs; each epoch is one optimizer step accumulated over micro-batches of the whole
   rollout batch, loss ``losses.grpo_loss`` (clip ε_low/ε_high, k3 KL, the loss_type's aggregation made exact
   over the batch: sequence means / N for grpo, tokens / all tokens for bnpo and dapo, Σ / (N·L_max) for
   dr_grpo). Epochs after the first see ρ ≠ 1, so the clip acts.
5. **serve the new weights** — the parameters were updated in place, so the engine already computes with
   them; ``LLMEngine.reset_prefix_cache()`` drops K/V cached from the old ones.

Expert iteration (``algorithm="expert_iteration"``; Anthony et al. 2017, STaR, Zelikman et al. 2022): the same
rollout, keep the samples the verifier accepts, one SFT step per epoch on them (the token mean over every
kept sample of the step).

``precision``: "fp32", "bf16"/"fp16" autocast for the learner's forward/backward and the old/reference
log-prob passes (weights stay fp32), or "auto" (``lmstack.cpu.choose_precision``: bf16 where this CPU multiplies
it natively and faster). ``rollout_dtype``: the engine's training rollouts alone — "bf16" runs their linear
products (and the tied unembedding) as bf16 GEMMs on a packed bf16 copy of the fp32 weights, rebuilt after each
optimizer step (``ops.gemm.inference_dtype``), outputs back in fp32; "fp32"; "auto" = bf16 where
``choose_precision("auto")`` picks it. As in verl/OpenRLHF (a bf16 sampler beside an fp32 learner) π_old is the
learner's own recomputation, so the sampler's precision changes which samples are drawn, not the loss's ratio
(docs/align.md, "Rollout throughput"). Held-out evaluation generates in fp32.

Data parallel under torchrun (WORLD_SIZE > 1, ``align.distributed``): rank r takes the r-th slice of each step's
P prompts (P divisible by the ranks) with the per-sample seeds they have in one process, generates them on its
own engine, and trains on its rows through ``lmstack.parallel``'s DDP. Groups never cross ranks; the rewards,
lengths and flags are gathered so advantages (batch std included), metrics and the loss normalisers (N rows,
the rollout batch's token count) are the global batch's: M ranks give the losses and gradients of one process
on the same prompts. Expert iteration trains each rank on its own verified samples (the ranks keep different
numbers), each token's loss divided by the kept tokens of all ranks, so the averaged gradient is the one
process's; a rank that kept none joins the all-reduce with a zero-weighted backward. Held-out evaluation is
split over the ranks and summed.

Metrics per step go to ``metrics.jsonl`` (reward mean/std overall and per function, failures, fraction of
groups with zero std, clip fractions, KL, entropy, completion lengths, truncation rate, seconds for generation /
log-probs / training and their tokens/s) and ``grpo.png``; held-out accuracy (greedy) at the start, every
``eval_every`` steps and at the end.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from lmstack import utils
from lmstack.align import distributed as D
from lmstack.align.data import Example, collate, encode_prompt
from lmstack.align.logprobs import batch_logprobs
from lmstack.align.losses import (
    GRPO_LOSS_TYPES,
    PG_LOSSES,
    group_advantages,
    grpo_loss,
    masked_mean,
    rloo_advantages,
    sft_loss,
    zero_std_fraction,
)
from lmstack.align.rewards import REWARDS, score
from lmstack.align.tasks import TASKS, get_task
from lmstack.cpu import TRAIN_PRECISIONS, choose_precision
from lmstack.inference.engine import GenerationError
from lmstack.inference.llm import LLM
from lmstack.inference.sampling import SamplingParams
from lmstack.ops.gemm import inference_dtype
from lmstack.train import checkpoint as ckpt
from lmstack.train.losses import IGNORE_INDEX
from lmstack.train.optim import AdamW, clip_grad_norm

ALGORITHMS = ("grpo", "expert_iteration")
ADVANTAGES = ("group", "batch", "none", "rloo")
ROLLOUT_DTYPES = ("auto", "fp32", "bf16")


def choose_rollout_dtype(
    requested: str, device: str | torch.device = "cpu", features=None, measure=None
) -> tuple[str, str]:
    """(dtype, reason) of the training rollouts' GEMMs for ``requested`` in ``ROLLOUT_DTYPES``: "auto" is bf16
    where ``lmstack.cpu.choose_precision("auto")`` picks bf16 on a CPU (native bf16 matmul, measured faster;
    ``features``/``measure`` as there), else fp32; bf16 is implemented for the CPU's oneDNN GEMMs only."""
    if requested not in ROLLOUT_DTYPES:
        raise ValueError(f"rollout_dtype={requested!r}; expected one of {ROLLOUT_DTYPES}")
    dev = torch.device(device)
    if dev.type != "cpu":
        if requested == "bf16":
            raise ValueError(
                f"rollout_dtype='bf16' is implemented for CPU rollouts (ops.gemm); the model is on {dev}"
            )
        return "fp32", f"{requested} on {dev.type}: fp32"
    if requested != "auto":
        return requested, "as configured"
    kw = {} if measure is None else {"measure": measure}
    choice = choose_precision("auto", dev, features, **kw)
    return choice.precision, choice.reason


@dataclass
class GRPOConfig:
    task: str = "arithmetic"
    task_args: dict = field(default_factory=dict)
    rewards: tuple[str, ...] = ("correct", "format")
    reward_weights: dict[str, float] = field(default_factory=dict)
    algorithm: str = "grpo"
    steps: int = 20
    prompts_per_step: int = 8  # P
    num_generations: int = 4  # G
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ("</answer>",)
    epochs: int = 1  # μ optimizer steps per rollout batch
    micro_batch: int = 16  # sequences per forward/backward
    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss_type: str = "grpo"
    eps_low: float = 0.2
    eps_high: float | None = None  # None: = eps_low; DAPO's clip-higher uses 0.28
    pg: str = "clip"
    beta: float = 0.0  # k3 KL coefficient; > 0 keeps a frozen reference copy
    advantage: str = "group"
    mask_truncated: bool = (
        False  # completions cut at max_new_tokens get no loss (DAPO's overlong filtering)
    )
    chat: bool = True
    system: str | None = None
    train_problems: int = 2000
    eval_problems: int = 64
    eval_every: int = 0  # 0: at the start and the end only
    seed: int = 0
    precision: str = "fp32"  # fp32 | bf16 | fp16 autocast for the learner | auto (lmstack.cpu)
    rollout_dtype: str = "fp32"  # fp32 | bf16 GEMMs for the engine's training rollouts | auto
    out_dir: str = "runs/grpo"
    ckpt_interval: int = 0  # 0: only at the end
    max_num_seqs: int = 64  # engine options
    max_num_batched_tokens: int = 1024

    def __post_init__(self):
        self.rewards, self.stop = tuple(self.rewards), tuple(self.stop)
        choices = {
            "algorithm": ALGORITHMS,
            "loss_type": tuple(GRPO_LOSS_TYPES),
            "pg": PG_LOSSES,
            "advantage": ADVANTAGES,
            "task": tuple(TASKS),
            "precision": TRAIN_PRECISIONS,
            "rollout_dtype": ROLLOUT_DTYPES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; expected one of {allowed}")
        for name in (
            "steps",
            "prompts_per_step",
            "num_generations",
            "max_new_tokens",
            "epochs",
            "micro_batch",
            "train_problems",
            "eval_problems",
        ):
            utils.check_int(name, getattr(self, name), ValueError, 1)
        unknown = [r for r in self.rewards if r not in REWARDS]
        if unknown or not self.rewards:
            raise ValueError(
                f"rewards={list(self.rewards)}; expected a non-empty list from {sorted(REWARDS)}"
            )
        if (
            self.algorithm == "grpo"
            and self.num_generations == 1
            and self.advantage in ("group", "rloo")
        ):
            raise ValueError(
                f"num_generations=1 with advantage={self.advantage!r}: a group of one sample has no "
                "spread, so every advantage would be 0 (and its std is undefined); use G >= 2"
            )
        if not self.lr > 0 or self.beta < 0 or self.temperature < 0:
            raise ValueError(
                f"lr={self.lr} must be > 0, beta={self.beta} and temperature={self.temperature} >= 0"
            )


def paired_accuracy(before: list[int], after: list[int], level: float = 0.95) -> dict:
    """Two evaluations of the same n problems (0/1 each): both accuracies with Wilson score intervals, and
    McNemar's exact test of "no change" — of the d discordant problems (b fixed: 0 → 1, w broken: 1 → 0),
    b ~ Binomial(d, ½) under the null, two-sided p (McNemar 1947; the exact form, scipy's ``binomtest``)."""
    from scipy.stats import binomtest

    if len(before) != len(after) or not before:
        raise ValueError(
            f"paired_accuracy needs two equal non-empty lists; got {len(before)} and {len(after)}"
        )
    n = len(before)

    def acc(v):
        k = int(sum(v))
        ci = binomtest(k, n).proportion_ci(level, method="wilson")
        return {"correct": k, "accuracy": k / n, "ci": [float(ci.low), float(ci.high)]}

    fixed = sum(1 for a, b in zip(before, after) if not a and b)
    broken = sum(1 for a, b in zip(before, after) if a and not b)
    p = float(binomtest(fixed, fixed + broken).pvalue) if fixed + broken else 1.0
    return {
        "problems": n,
        "before": acc(before),
        "after": acc(after),
        "fixed": fixed,
        "broken": broken,
        "mcnemar_p": p,
    }


class GRPOTrainer:
    """``GRPOTrainer(config, model, tokenizer).fit()``; the model is trained in place and served by
    ``self.llm`` (an ``LLM`` whose engine holds the same parameter tensors)."""

    def __init__(
        self,
        config: GRPOConfig,
        model,
        tokenizer,
        progress: bool = True,
        reward_fns: dict | None = None,
    ):
        """``reward_fns``: name -> f(problem, completion) in place of ``config.rewards`` (weights by name)."""
        self.rank, self.world = D.start()
        if self.world > 1:
            D.rank_slice(config.prompts_per_step, self.rank, self.world, "prompts_per_step")
        self.device = next(model.parameters()).device
        # the resolved precision is what the config (and so each checkpoint) records
        self.precision_choice = choose_precision(config.precision, self.device)
        rollout, why = choose_rollout_dtype(config.rollout_dtype, self.device)
        self.config = c = dataclasses.replace(
            config, precision=self.precision_choice.precision, rollout_dtype=rollout
        )
        if progress and self.rank == 0:
            print(self.precision_choice.line())
            print(f"rollout dtype: {rollout} ({why})")
        self.reward_fns = reward_fns if reward_fns is not None else list(c.rewards)
        self.progress = progress
        torch.manual_seed(c.seed)
        self.model, self.tokenizer = model, tokenizer
        self.task = get_task(c.task, **c.task_args)
        self.train_set = self.task.generate(c.train_problems, c.seed, "train")
        self.test_set = self.task.generate(c.eval_problems, c.seed, "test")
        self.train_prompts = [
            encode_prompt(tokenizer, p.prompt, c.system, c.chat) for p in self.train_set
        ]
        self.test_prompts = [
            encode_prompt(tokenizer, p.prompt, c.system, c.chat) for p in self.test_set
        ]
        max_len = model.config.max_seq_len
        for split, prompts in (("train", self.train_prompts), ("test", self.test_prompts)):
            for i, ids in enumerate(prompts):
                if len(ids) + c.max_new_tokens > max_len:
                    raise ValueError(
                        f"{split} prompt {i} has {len(ids)} tokens: with max_new_tokens="
                        f"{c.max_new_tokens} it exceeds the model's context of {max_len} tokens"
                    )
        # the engine fuses q/k/v and gate/up for its rollouts (no_grad); the learner's backward runs the separate
        # projections, whose parameters are views of the fused weights, so each optimizer step reaches both
        self.llm = LLM(
            model,
            tokenizer,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            seed=c.seed,
        )
        assert self.llm.engine.model is model  # one model: the engine serves the learner's tensors
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if c.beta > 0 else None
        # the learner: the same module, wrapped for gradient averaging when there are several ranks (rank 0's
        # weights are broadcast, so every engine serves the same model)
        self.learner = model
        if self.world > 1:
            from lmstack.parallel.ddp import DataParallel

            self.learner = DataParallel(model)
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        self.optimizer = AdamW(
            [
                {"params": decay, "weight_decay": c.weight_decay},
                {"params": rest, "weight_decay": 0.0},
            ],
            lr=c.lr,
            betas=(0.9, 0.99),
        )
        self.order = list(range(len(self.train_set)))
        random.Random(c.seed).shuffle(self.order)
        self.step = 0
        self.out_dir = Path(c.out_dir)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.history: list[dict] = []

    # ---- rollout ---------------------------------------------------------------------------------------
    def step_problems(self, step: int) -> list[int]:
        P, n = self.config.prompts_per_step, len(self.order)
        return [self.order[(step * P + k) % n] for k in range(P)]

    def rollout(
        self,
        prompts: list[list[int]],
        step: int,
        greedy: bool = False,
        G: int | None = None,
        offset: int = 0,
    ):
        """G samples per prompt (prompt-major: the G samples of prompt i are rows i·G … i·G+G−1); sample k's
        seed is that of row ``offset + k`` of the step (a rank's rows continue the ranks before it)."""
        c = self.config
        G = c.num_generations if G is None else G
        params = [
            SamplingParams(
                temperature=0.0 if greedy else c.temperature,
                top_p=c.top_p,
                max_tokens=c.max_new_tokens,
                stop=c.stop,
                seed=(c.seed * 1_000_003 + step) * 100_003 + offset + k,
            )
            for k in range(len(prompts) * G)
        ]
        self.model.eval()
        try:
            return self.llm.generate([p for p in prompts for _ in range(G)], params)
        except (
            GenerationError
        ) as e:  # a failed request (e.g. NaN logits) is counted, scored 0 and not trained
            return e.outputs

    def completion_text(self, out) -> str:
        """The completion as the reward sees it: every generated token (the stop string included, which the
        engine's ``text`` leaves out) but a final end-of-sequence token."""
        ids = list(out.token_ids)
        eos = self.llm.engine.scheduler.eos_token_id
        if ids and eos is not None and ids[-1] == eos:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    # ---- learning --------------------------------------------------------------------------------------
    def autocast(self):
        """bf16/fp16 autocast of the learner's forward (Book of LLMs §5.4): matmuls in low precision, the
        fp32 weights and the log-softmax (``token_logprobs``) as they are."""
        if self.config.precision == "fp32":
            return nullcontext()
        return torch.autocast(
            self.device.type, dtype=utils.torch_dtype(self.config.precision, ("bf16", "fp16"))
        )

    def logprobs(self, model, batch, entropy: bool = False):
        with self.autocast():
            return batch_logprobs(model, batch, entropy=entropy)

    def _batches(self, examples: list[Example]):
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        mb = self.config.micro_batch
        return [collate(examples[i : i + mb], pad) for i in range(0, len(examples), mb)]

    @torch.no_grad()
    def _logps(self, model, batches) -> list[torch.Tensor]:
        model.eval()
        return [self.logprobs(model, b)[0] for b in batches]

    def train_step(self) -> dict:
        c = self.config
        t0 = time.perf_counter()
        G = c.num_generations
        share = D.rank_slice(c.prompts_per_step, self.rank, self.world, "prompts_per_step")
        idx = self.step_problems(self.step)[share]  # this rank's prompts, whole groups
        problems = [self.train_set[i] for i in idx]
        with inference_dtype(torch.bfloat16 if c.rollout_dtype == "bf16" else None):
            outs = self.rollout(
                [self.train_prompts[i] for i in idx], self.step, offset=share.start * G
            )
        t_gen = time.perf_counter() - t0
        texts = [self.completion_text(o) if o.error is None else "" for o in outs]
        rep = [p for p in problems for _ in range(G)]
        res = score(rep, texts, self.reward_fns, c.reward_weights)
        completions = [list(o.token_ids) for o in outs]
        names = list(res.per_fn)
        # per row: total reward, length, truncated, failed, each function's reward; gathered over the ranks
        local = torch.tensor(
            [
                [
                    res.total[k],
                    len(completions[k]),
                    o.finish_reason == "length",
                    o.error is not None,
                ]
                + [res.per_fn[n][k] for n in names]
                for k, o in enumerate(outs)
            ],
            dtype=torch.float64,
        )
        rows = D.gather_rows(local)  # (N, 4 + n_fn), N = P·G rows in prompt order
        fn_failures = D.all_sum(torch.tensor([res.failures[n] for n in names], dtype=torch.float64))
        rewards, lengths = rows[:, 0].float(), rows[:, 1]
        truncated, failed = rows[:, 2].bool(), rows[:, 3].bool()
        examples = [
            Example(list(self.train_prompts[idx[k // G]]), completions[k] or [0])
            for k in range(len(outs))
        ]
        batches = self._batches(examples)
        m: dict = {
            "step": self.step + 1,
            "reward": float(rewards.mean()),
            "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "frac_reward_zero_std": zero_std_fraction(rewards, G),
            "completion_length": float(lengths.mean()),
            "completion_length_max": int(lengths.max()),
            "completion_length_min": int(lengths.min()),
            "truncated": float(truncated.float().mean()),
            "rollout_failures": int(failed.sum()),
        }
        for j, name in enumerate(names):
            v = rows[:, 4 + j].float()
            m[f"rewards/{name}"], m[f"rewards/{name}_std"] = (
                float(v.mean()),
                float(v.std()) if len(v) > 1 else 0.0,
            )
            m[f"reward_failures/{name}"] = int(fn_failures[j])
        mine = slice(share.start * G, share.stop * G)  # this rank's rows of the gathered batch
        if c.algorithm == "grpo":
            rewards = rewards.masked_fill(failed, 0.0)
            dropped = truncated if c.mask_truncated else failed
            train = self._grpo_update(batches, rewards, dropped, m, failed, mine)
        else:
            correct = (
                torch.tensor(res.per_fn.get("correct", res.total))
                .masked_fill(failed[mine], 0.0)  # this rank's rows
                .tolist()
            )
            train = self._expert_iteration_update(examples, correct, m)
        t_logp, t_train = train
        n_gen = int(lengths.sum())
        n_train = sum(int((b.y != IGNORE_INDEX).sum()) for b in batches)
        n_train = int(D.all_sum(torch.tensor([n_train]))[0])
        self.llm.engine.reset_prefix_cache()  # cached K/V were computed with the weights before this step
        self.step += 1
        t_gen, t_logp, t_train = (D.all_max(t) for t in (t_gen, t_logp, t_train))
        m.update(
            gen_s=t_gen,
            logprob_s=t_logp,
            train_s=t_train,
            step_s=D.all_max(time.perf_counter() - t0),
            gen_tokens_per_s=n_gen / max(t_gen, 1e-9),
            train_tokens_per_s=n_train * c.epochs / max(t_train, 1e-9),
        )
        return m

    def _grpo_update(self, batches, rewards, dropped, m, failed, mine=None) -> tuple[float, float]:
        """``rewards``, ``dropped`` (rows that get no loss: failed requests; with mask_truncated, truncated
        ones) and ``failed``: (N,) over the whole rollout batch; ``batches`` hold this rank's rows ``mine``.

        Each loss_type's normaliser is the whole batch's (N rows; its response-token count), scaled by the
        number of ranks M because DDP averages the M gradients: the sum over ranks is the one-process loss."""
        c = self.config
        G, M = c.num_generations, self.world
        mine = slice(0, len(rewards)) if mine is None else mine
        if c.advantage == "rloo":
            adv = rloo_advantages(rewards, G)
        else:
            adv = group_advantages(rewards, G, scale=c.advantage)
        adv, keep_out = adv[mine], (dropped | failed)[mine]
        t0 = time.perf_counter()
        old = self._logps(self.model, batches)  # π_old: once per rollout batch
        ref = (
            self._logps(self.ref_model, batches)
            if self.ref_model is not None
            else [None] * len(batches)
        )
        t_logp = time.perf_counter() - t0
        masks = [(b.y != IGNORE_INDEX) for b in batches]
        rows = torch.split(keep_out, [len(b.y) for b in batches])
        masks = [mk & ~r[:, None] for mk, r in zip(masks, rows)]
        N = len(rewards)
        n_tokens = int(D.all_sum(torch.tensor([sum(int(mk.sum()) for mk in masks)]))[0])
        advs = torch.split(adv, [len(b.y) for b in batches])
        t0 = time.perf_counter()
        self.model.train()
        sums: dict[str, float] = {}
        for _ in range(c.epochs):
            total_loss = 0.0
            for i, (b, mk, a, o, r) in enumerate(zip(batches, masks, advs, old, ref)):
                sync = self.learner.no_sync() if M > 1 and i < len(batches) - 1 else nullcontext()
                with sync:
                    logp, ent = self.logprobs(self.learner, b, entropy=True)
                    loss, lm = grpo_loss(
                        logp,
                        o,
                        a,
                        mk,
                        loss_type=c.loss_type,
                        eps_low=c.eps_low,
                        eps_high=c.eps_high,
                        beta=c.beta,
                        ref_logp=r,
                        max_len=c.max_new_tokens,
                        pg=c.pg,
                        num_tokens=n_tokens / M if c.loss_type == "dapo" else None,
                    )
                    # exact over the rollout batch: sequence-mean types weigh each micro-batch by its rows,
                    # bnpo's micro-batch token mean by its tokens (dapo divides by the batch's tokens itself)
                    if c.loss_type == "dapo":
                        weight = 1.0
                    elif c.loss_type == "bnpo":
                        weight = float(mk.sum()) * M / max(n_tokens, 1)
                    else:
                        weight = len(b.y) * M / N
                    (loss * weight).backward()
                total_loss += float(loss.detach()) * weight / M
                share = float(mk.sum()) / max(n_tokens, 1)
                lm["entropy"] = float(masked_mean(ent, mk))
                for k, v in lm.items():
                    sums[k] = sums.get(k, 0.0) + v * share / c.epochs
            norm = (
                clip_grad_norm([p for p in self.model.parameters() if p.requires_grad], c.grad_clip)
                if c.grad_clip > 0
                else torch.tensor(0.0)
            )
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            sums["loss"] = (
                sums.get("loss", 0.0) + float(D.all_sum(torch.tensor([total_loss]))[0]) / c.epochs
            )
            sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(norm) / c.epochs
        keys = [
            k for k in sums if k not in ("loss", "grad_norm")
        ]  # token-share sums: add the ranks'
        if M > 1 and keys:
            sums.update(zip(keys, D.all_sum(torch.tensor([sums[k] for k in keys])).tolist()))
        m.update(sums)
        return t_logp, time.perf_counter() - t0

    def _expert_iteration_update(self, examples, correct, m) -> tuple[float, float]:
        """SFT on this rank's verified samples: each micro-batch's token sum over the kept tokens of all
        ranks (×M, since DDP averages), so the ranks' gradients add up to the one-process token mean."""
        c, M = self.config, self.world
        kept = [ex for ex, v in zip(examples, correct) if v >= 1.0]
        batches = self._batches(kept)
        n_local = sum(int((b.y != IGNORE_INDEX).sum()) for b in batches)
        n_kept, n_tokens = D.all_sum(torch.tensor([len(kept), n_local])).tolist()
        m["kept"] = int(n_kept)
        t0 = time.perf_counter()
        if not n_kept:  # nothing verified on any rank: no step
            return 0.0, time.perf_counter() - t0
        # a rank that kept nothing still joins each epoch's all-reduce: one sample, weight 0
        weights = [M / n_tokens] * len(batches) if batches else [0.0]
        batches = batches or self._batches(examples[:1])
        self.model.train()
        total = 0.0
        for _ in range(c.epochs):
            for i, (b, w) in enumerate(zip(batches, weights)):
                sync = self.learner.no_sync() if M > 1 and i < len(batches) - 1 else nullcontext()
                with sync:
                    logp, _ = self.logprobs(self.learner, b)
                    mask = b.y != IGNORE_INDEX
                    loss = (
                        sft_loss(logp, mask) * float(mask.sum()) * w
                    )  # token sum / all kept tokens
                    loss.backward()
                total += float(loss.detach()) / M / c.epochs
            clip_grad_norm([p for p in self.model.parameters() if p.requires_grad], c.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        m["loss"] = float(D.all_sum(torch.tensor([total]))[0])
        return 0.0, time.perf_counter() - t0

    # ---- evaluation, the loop, files ---------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy (correct reward) and format rate on the held-out problems (every M-th problem
        from its rank under data parallelism, summed over the ranks), and ``eval_correct``: each problem's
        0/1 in test-set order (for a paired comparison of two evaluations, ``paired_accuracy``)."""
        n = len(self.test_set)
        mine = list(range(n))[self.rank :: self.world]
        outs = self.rollout([self.test_prompts[i] for i in mine], step=-1, greedy=True, G=1)
        problems = [self.test_set[i] for i in mine]
        res = score(problems, [self.completion_text(o) for o in outs], ["correct", "format"])
        self.llm.engine.reset_prefix_cache()
        per = torch.zeros(2, n, dtype=torch.float64)  # (correct, format) × problem
        per[:, mine] = torch.tensor([res.per_fn["correct"], res.per_fn["format"]], dtype=per.dtype)
        per = D.all_sum(per)
        return {
            "eval_accuracy": float(per[0].sum()) / n,
            "eval_format": float(per[1].sum()) / n,
            "eval_correct": [int(v >= 1.0) for v in per[0].tolist()],
        }

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, row: dict) -> None:
        """Rank 0 appends the row to metrics.jsonl; every rank keeps it (the rows are the same on all)."""
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
        self.history.append(row)

    def save_checkpoint(self) -> Path:
        """Rank 0 writes it (every replica holds the same weights and optimizer states)."""
        path = None
        if self.is_main:
            path = ckpt.save_checkpoint(
                self.out_dir / "checkpoints",
                self.step,
                self.model,
                self.optimizer,
                {"config": asdict(self.config), "kind": "grpo"},
                keep_last=2,
            )
        D.barrier()
        return path or ckpt.latest_checkpoint(self.out_dir / "checkpoints")

    def resume(self, path=None) -> int:
        p = Path(path) if path is not None else ckpt.latest_checkpoint(self.out_dir / "checkpoints")
        if p is None:
            raise FileNotFoundError(
                f"no checkpoint to resume from in {self.out_dir / 'checkpoints'}"
            )
        meta = ckpt.load_checkpoint(p, self.model, self.optimizer)
        self.step = int(meta["step"])
        self.llm.engine.reset_prefix_cache()
        if self.is_main and self.metrics_path.exists():  # the steps after it will be logged again
            rows = [
                r for _, r in utils.read_jsonl(self.metrics_path) if r.get("step", 0) <= self.step
            ]
            utils.atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))
        return self.step

    def fit(self) -> dict:
        c = self.config
        if self.step == 0:
            if self.is_main and self.metrics_path.exists():
                self.metrics_path.unlink()
            start = self.evaluate()
            self.log({"step": 0, **start})
        bar = tqdm(
            total=c.steps,
            initial=self.step,
            desc=c.algorithm,
            unit="step",
            disable=not (self.progress and self.is_main),
        )
        t_start = time.perf_counter()
        while self.step < c.steps:
            m = self.train_step()
            if c.eval_every and self.step % c.eval_every == 0 and self.step < c.steps:
                m.update(self.evaluate())
            if self.step == c.steps:
                m.update(self.evaluate())
            self.log(m)
            if c.ckpt_interval and self.step % c.ckpt_interval == 0 and self.step < c.steps:
                self.save_checkpoint()
            bar.set_postfix(
                {
                    "reward": f"{m['reward']:.2f}",
                    "gen": f"{m['gen_s']:.1f}s",
                    "train": f"{m['train_s']:.1f}s",
                },
                refresh=False,
            )
            bar.update(1)
        bar.close()
        self.save_checkpoint()
        self.plot()
        rows = [r for r in self.history if "reward" in r]
        first = next((r for r in self.history if r.get("step") == 0), {})
        last = self.history[-1] if self.history else {}
        paired = (
            paired_accuracy(first["eval_correct"], last["eval_correct"])
            if "eval_correct" in first and "eval_correct" in last
            else None
        )
        return {
            "steps": self.step,
            "seconds": time.perf_counter() - t_start,
            "eval_accuracy_start": first.get("eval_accuracy"),
            "eval_accuracy_end": last.get("eval_accuracy"),
            "eval_paired": paired,
            "reward_first": rows[0]["reward"] if rows else None,
            "reward_last": rows[-1]["reward"] if rows else None,
            "gen_s": sum(r["gen_s"] for r in rows),
            "logprob_s": sum(r["logprob_s"] for r in rows),
            "train_s": sum(r["train_s"] for r in rows),
            "metrics": str(self.metrics_path),
        }

    def plot(self) -> Path | None:
        if not self.is_main:
            return None
        rows = (
            [r for _, r in utils.read_jsonl(self.metrics_path)]
            if self.metrics_path.exists()
            else []
        )
        steps = [r for r in rows if "reward" in r]
        if not steps:
            return None
        plt = utils.pyplot()
        fig, ax = plt.subplots(2, 2, figsize=(11, 7))
        x = [r["step"] for r in steps]
        ax[0, 0].plot(x, [r["reward"] for r in steps], label="train reward (mean)")
        ev = [r for r in rows if "eval_accuracy" in r]
        ax[0, 0].plot(
            [r["step"] for r in ev],
            [r["eval_accuracy"] for r in ev],
            "o-",
            label="held-out accuracy",
        )
        ax[0, 0].set_title("reward / accuracy")
        ax[0, 0].legend()
        ax[0, 1].plot(x, [r["completion_length"] for r in steps], label="completion length")
        ax[0, 1].plot(
            x,
            [r["truncated"] * self.config.max_new_tokens for r in steps],
            label="truncated × L_max",
        )
        ax[0, 1].legend()
        ax[0, 1].set_title("tokens")
        for key in ("kl", "entropy", "clip_ratio/region", "frac_reward_zero_std"):
            if key in steps[0]:
                ax[1, 0].plot(x, [r[key] for r in steps], label=key)
        ax[1, 0].legend()
        ax[1, 0].set_title("KL, entropy, clipping")
        g = [r["gen_s"] for r in steps]
        lp = [r["logprob_s"] for r in steps]
        t = [r["train_s"] for r in steps]
        ax[1, 1].bar(x, g, label="generation")
        ax[1, 1].bar(x, lp, bottom=g, label="old/ref log-probs")
        ax[1, 1].bar(x, t, bottom=[a + b for a, b in zip(g, lp)], label="training")
        ax[1, 1].legend()
        ax[1, 1].set_title("seconds per step")
        for a in ax.flat:
            a.set_xlabel("step")
        fig.suptitle(
            f"{self.config.algorithm} on {self.config.task}: P={self.config.prompts_per_step}, "
            f"G={self.config.num_generations}, μ={self.config.epochs}"
        )
        fig.tight_layout()
        return utils.save_png(fig, self.out_dir / f"{self.config.algorithm}.png")
