"""Direct preference optimisation on lmstack's Trainer loop (``ModelTrainer``).

Each micro-batch holds B pairs as 2B rows [chosen_1..B, rejected_1..B] (TRL's layout); the policy's sequence
log-probs Σ_t log π_θ(y_t|x, y_<t) over each response go into ``losses.dpo_loss`` with the reference's.
The reference is either a frozen copy of the starting model (``reference="model"``: two models in memory) or
its log-probs computed once before training (``reference="precomputed"``, TRL's
``precompute_ref_log_probs``: one model in memory, one extra pass over the data). Logged per step: TRL's
rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies and logps/chosen, logps/rejected.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch

from lmstack.align import distributed as D
from lmstack.align.data import Example, collate
from lmstack.align.logprobs import batch_logprobs
from lmstack.align.losses import DPO_LOSSES, dpo_loss, dpo_rewards
from lmstack.align.sft import ModelTrainer
from lmstack.train.config import TrainConfig, TrainConfigError
from lmstack.train.data import Batch
from lmstack.train.losses import IGNORE_INDEX
from lmstack.train.plot import read_metrics
from lmstack.utils import pyplot, save_png

REFERENCES = ("precomputed", "model")
#: what ``pair_loss`` reports for a batch of pairs (TRL's names) and its loss
METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


class DPOTrainer(ModelTrainer):
    """``pairs``: (chosen Example, rejected Example) with the same prompt."""

    def __init__(
        self,
        config: TrainConfig,
        model,
        pairs: Sequence[tuple[Example, Example]],
        val_pairs: Sequence[tuple[Example, Example]] = (),
        tokenizer=None,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        reference: str = "precomputed",
        pad_id: int = 0,
        **kw,
    ):
        if loss_type not in DPO_LOSSES:
            raise TrainConfigError(f"loss_type={loss_type!r}; expected one of {DPO_LOSSES}")
        if reference not in REFERENCES:
            raise TrainConfigError(f"reference={reference!r}; expected one of {REFERENCES}")
        if not pairs:
            raise TrainConfigError("no preference pairs")
        if not beta > 0:
            raise TrainConfigError(f"beta={beta} must be > 0")
        super().__init__(config, model, tokenizer, **kw)
        self.pairs, self.val_pairs = list(pairs), list(val_pairs)
        self.beta, self.loss_type, self.label_smoothing, self.pad_id = (
            beta,
            loss_type,
            label_smoothing,
            pad_id,
        )
        self.reference = reference
        self.ref_model = None
        if reference == "model":
            self.ref_model = copy.deepcopy(self.raw_model).eval().requires_grad_(False)
            self.ref_logps = None
        else:  # once, with the starting weights: the reference never needs to be in memory again
            self.ref_logps = self.sequence_logps(self.raw_model, self.pairs)  # (N, 2)
            self.val_ref_logps = (
                self.sequence_logps(self.raw_model, self.val_pairs) if self.val_pairs else None
            )
        self._index: list[int] = []
        self.last_metrics: dict[str, float] = {}

    def pair_batch(self, pairs: Sequence[tuple[Example, Example]]) -> tuple[Batch, torch.Tensor]:
        """(Batch of 2B rows, response token counts (2B,))."""
        batch = collate([c for c, _ in pairs] + [r for _, r in pairs], self.pad_id).to(self.device)
        return batch, (batch.y != IGNORE_INDEX).sum(-1)

    @torch.no_grad()
    def sequence_logps(self, model, pairs) -> torch.Tensor:
        """(N, 2) Σ log π over each chosen and rejected response, B pairs at a time; under data parallelism
        each rank computes every M-th pair and the table is summed over the ranks."""
        was = model.training
        model.eval()
        table = torch.zeros(len(pairs), 2)
        mine = list(range(len(pairs)))[self.dp_rank :: self.dp_size]
        for i in range(0, len(mine), self.config.batch_size):
            idx = mine[i : i + self.config.batch_size]
            batch, _ = self.pair_batch([pairs[j] for j in idx])
            with self.autocast():
                s = batch_logprobs(model, batch)[0].sum(-1).float()
            n = s.shape[0] // 2
            table[idx] = torch.stack([s[:n], s[n:]], dim=1).cpu()
        model.train(was)
        return D.all_sum(table).float() if self.dp_size > 1 else table

    def next_batch(self) -> Batch:
        self._index = self.sample_indices(len(self.pairs))
        batch, self._lengths = self.pair_batch([self.pairs[i] for i in self._index])
        return batch

    def _ref(
        self, batch: Batch, index: list[int], table: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if table is not None:
            ref = table[index].to(self.device)
            return ref[:, 0], ref[:, 1]
        with torch.no_grad(), self.autocast():
            s = batch_logprobs(self.ref_model, batch)[0].sum(-1).float()
        n = s.shape[0] // 2
        return s[:n], s[n:]

    def pair_loss(
        self,
        batch: Batch,
        lengths: torch.Tensor,
        ref_c: torch.Tensor,
        ref_r: torch.Tensor,
        model=None,
    ):
        """(mean DPO loss over the pairs, TRL's metrics) of the policy ``model`` (default: the learner)."""
        with self.autocast():
            s = batch_logprobs(model or self.model, batch)[0].sum(-1).float()
        n = s.shape[0] // 2
        losses = dpo_loss(
            s[:n],
            s[n:],
            ref_c,
            ref_r,
            self.beta,
            self.loss_type,
            self.label_smoothing,
            lengths[:n].float(),
            lengths[n:].float(),
        )
        m = {k: float(v) for k, v in dpo_rewards(s[:n], s[n:], ref_c, ref_r, self.beta).items()}
        m["logps/chosen"], m["logps/rejected"] = (
            float(s[:n].detach().mean()),
            float(s[n:].detach().mean()),
        )
        return losses.mean(), m

    def forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        ref_c, ref_r = self._ref(batch, self._index, self.ref_logps)
        loss, self.last_metrics = self.pair_loss(batch, self._lengths, ref_c, ref_r)
        return loss, torch.zeros((), device=loss.device)

    def train_step(self) -> dict[str, float]:
        m = super().train_step()
        # the last micro-batch's DPO metrics, averaged over the ranks' equal slices
        m.update({k: self.reduce_metric(v) for k, v in self.last_metrics.items()})
        return m

    def plot(self, baseline: float | None = None) -> Path | None:
        """The loss curve (``loss_curve.png``) and the implicit-reward margins and accuracies over the steps
        (``dpo_margins.png``) in the run folder; rank 0 only."""
        path = super().plot(baseline)
        if self.is_main:
            plot_margins(
                self.metrics_path,
                self.out_dir / "dpo_margins.png",
                f"DPO ({self.loss_type}, β={self.beta}, reference {self.reference})",
            )
        return path

    @torch.no_grad()
    def evaluate(self, max_batches: int | None = None) -> dict[str, float]:
        """DPO loss and implicit-reward accuracy/margin over the validation pairs (every pair once)."""
        pairs = self.val_pairs or self.pairs
        table = (
            (self.val_ref_logps if self.val_pairs else self.ref_logps)
            if self.ref_model is None
            else None
        )
        self.model.eval()
        sums: dict[str, float] = {}
        n_total = 0
        mine = self.eval_share(range(len(pairs)))
        try:
            B = self.config.batch_size
            for i in range(0, len(mine), B):
                idx = mine[i : i + B]
                batch, lengths = self.pair_batch([pairs[j] for j in idx])
                ref_c, ref_r = self._ref(batch, idx, table)
                loss, m = self.pair_loss(batch, lengths, ref_c, ref_r, self.raw_model)
                m["loss"] = float(loss)
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v * len(idx)
                n_total += len(idx)
        finally:
            self.model.train()
        if (
            self.dp_size > 1
        ):  # every rank scored a share: add the sums (the keys are the same on all)
            keys = list(METRICS)  # fixed: a rank with no pairs to score adds zeros
            total = D.all_sum(torch.tensor([n_total] + [sums.get(k, 0.0) for k in keys]))
            n_total, sums = int(total[0]), dict(zip(keys, total[1:].tolist()))
        self.last_eval = {
            "val_loss": sums["loss"] / n_total,
            **{f"val_{k}": v / n_total for k, v in sums.items() if k != "loss"},
        }
        return self.last_eval


def plot_margins(metrics_path, png: Path, title: str = "DPO") -> Path | None:
    """DPO's implicit-reward margins and preference accuracies over the steps, training (each logged step's
    batch) and evaluation (the validation pairs, or the training pairs without them), from a run's
    ``metrics.jsonl``: two panels, one PNG."""
    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("kind") == "train" and "rewards/margins" in r]
    val = [r for r in rows if r.get("kind") == "eval" and "val_rewards/margins" in r]
    if not train and not val:
        return None
    plt = pyplot()
    fig, (ax_m, ax_a) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in (
        (ax_m, "rewards/margins", "margin r_w − r_l"),
        (ax_a, "rewards/accuracies", "accuracy (r_w > r_l)"),
    ):
        if train:
            ax.plot([r["step"] for r in train], [r[key] for r in train], label=f"train {label}")
        if val:
            ax.plot(
                [r["step"] for r in val],
                [r[f"val_{key}"] for r in val],
                "o-",
                label=f"evaluation {label}",
            )
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.legend()
    ax_m.axhline(0.0, color="grey", lw=0.5)
    ax_a.set_ylim(-0.05, 1.05)
    fig.suptitle(title)
    fig.tight_layout()
    return save_png(fig, png)


def sample_pairs(
    model,
    tokenizer,
    task,
    problems,
    num_generations: int = 8,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    chat: bool = True,
    system: str | None = None,
    stop: Sequence[str] = ("</answer>",),
    verify=None,
) -> list[dict]:
    """Preference pairs from the model's own samples (on-policy DPO data): for each problem, G samples from the
    engine, checked by the task's verifier (``verify(problem, text) -> 1.0 | 0.0``, default
    ``rewards.correctness_reward``); a problem with a correct and an incorrect sample gives
    {"prompt", "chosen": the first correct, "rejected": the first incorrect}. Problems with all samples right
    or all wrong give none.

    Under torchrun each rank samples a contiguous share of the problems (sample k keeps the seed it has in one
    process) and the rows are gathered, so every rank returns the one-process list."""
    from lmstack.align.data import encode_prompt
    from lmstack.align.rewards import correctness_reward
    from lmstack.inference.llm import LLM
    from lmstack.inference.sampling import SamplingParams

    verify = verify or correctness_reward
    rank, world = D.start()
    n, G = len(problems), num_generations
    lo, hi = n * rank // world, n * (rank + 1) // world  # this rank's problems
    rows: list[dict] = []
    if hi > lo:
        llm = LLM(model, tokenizer, seed=seed)
        eos = llm.engine.scheduler.eos_token_id
        prompts = [encode_prompt(tokenizer, p.prompt, system, chat) for p in problems[lo:hi]]
        params = [
            SamplingParams(
                temperature=temperature,
                max_tokens=max_new_tokens,
                stop=tuple(stop),
                seed=seed * 100_003 + lo * G + k,
            )
            for k in range(len(prompts) * G)
        ]
        outs = llm.generate([p for p in prompts for _ in range(G)], params)
        for i, problem in enumerate(problems[lo:hi]):
            texts = []
            for o in outs[i * G : (i + 1) * G]:
                ids = list(o.token_ids)
                texts.append(tokenizer.decode(ids[:-1] if ids and ids[-1] == eos else ids).strip())
            good = [t for t in texts if t and verify(problem, t) == 1.0]
            bad = [t for t in texts if t and verify(problem, t) == 0.0]
            if good and bad:
                rows.append(
                    {
                        "prompt": problem.prompt,
                        "chosen": good[0],
                        "rejected": bad[0],
                        "task": problem.task,
                    }
                )
    return [r for share in D.gather_objects(rows) for r in share]
