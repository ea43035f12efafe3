"""The one interface between the trainer and a parallel wrapper, and what its implementations share.

CS336 notes "混合并行": however the model is split (dp, ZeRO, tp, pp, cp), a training step is the
same few calls. ``ParallelWrapper`` declares them; ``plan.ParallelModel`` (lmstack's strategies)
and ``native.NativeParallelModel`` (torch's) implement them on top of ``WrapperBase``, which holds
the batch layout, the global gradient norm and the per-rank state dicts both need.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lmstack.parallel import collectives as C


@runtime_checkable
class ParallelWrapper(Protocol):
    """What ``lmstack.train.Trainer`` and ``lmstack.parallel.checkpoint`` call on a parallel model."""

    plan: Any  # the ParallelPlan it applies
    mesh: Any  # the DeviceMesh: sizes and this rank's coordinates per axis
    runner: nn.Module  # tokens (B, S) -> logits; what the trainer calls forward (and no_sync) on

    @property
    def sharded(self) -> bool:
        """A rank holds only part of the parameters or states (or runs replaced attention)."""

    @property
    def pipelined(self) -> bool:
        """Steps go through ``pipeline_step`` (pp > 1), not forward + backward per micro-batch."""

    @property
    def fp16_scaler_ok(self) -> bool:
        """A per-rank fp16 loss scaler stays in step across ranks."""

    def build_optimizer(
        self, optimizer_class: type, params=None, **kwargs
    ) -> torch.optim.Optimizer: ...

    def local_batch(self, batch): ...

    def forward_backward(
        self, tokens: Tensor, targets: Tensor, loss_fn, no_sync: bool = False
    ) -> float: ...

    def pipeline_step(self, tokens: Tensor, targets: Tensor, loss_parts) -> Tensor: ...

    def grad_norm(self) -> Tensor: ...

    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> Tensor: ...

    def full_state_dict(self, all_stages: bool = False) -> dict[str, Tensor]: ...

    def local_state_dict(self) -> dict[str, Tensor]: ...

    def load_local_state_dict(self, sd: dict[str, Tensor]) -> None: ...


GradItem = tuple[
    Tensor | None, str | None, bool
]  # (gradient, axis its pieces are split over, counted)


class WrapperBase:
    """Shared implementation of ``ParallelWrapper``. A subclass sets ``plan``, ``mesh``, ``model``,
    ``runner``, ``dp_group``, ``dp_size`` and the strategy slots (``pipeline``, ``ddp``,
    ``zero_optimizer``, ``fsdp``, ``cp_model``, ``tp_model``; None when unused) and provides
    ``_grad_items``, ``_split_axes`` and ``_full_state_dict``."""

    # ---- data layout ---------------------------------------------------------------------------
    def shard_batch(self, tokens: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """The global batch (B, S) -> this rank's part: B split over dp; S over cp (done inside the
        cp wrapper for tokens, in ``forward_backward`` for targets). TP and PP ranks of one replica
        see the same rows."""
        B = tokens.shape[0]
        if B % self.mesh.dp:
            raise ValueError(f"global batch B={B} is not divisible by dp={self.mesh.dp}")
        r = self.mesh.rank("dp")
        return tokens.chunk(self.mesh.dp)[r], targets.chunk(self.mesh.dp)[r]

    def local_batch(self, batch):
        """A batch the trainer sampled for this data-parallel rank -> what this rank computes on:
        under context parallelism the targets of this rank's sequence chunks (the inputs stay
        whole: the cp wrapper picks its tokens). Packing (document ids) is refused under cp and pp."""
        if (
            self.cp_model is not None or self.pipeline is not None
        ) and batch.document_ids is not None:
            axis = "cp" if self.cp_model is not None else "pp"
            raise ValueError(
                f"packing (document ids) is not supported with {axis} > 1: set packing = false"
            )
        if self.cp_model is None:
            return batch
        return type(batch)(
            batch.x, self.cp_model.shard(batch.y), batch.positions, batch.document_ids
        )

    @property
    def sharded(self) -> bool:
        """Whether a rank's model is not the plain single-process one: it holds only part of the
        parameters or optimizer states (tp, pp, ZeRO, ep), or its attention was replaced (cp's ring
        attention). The full parameters then come from ``full_state_dict()``."""
        return (
            self.mesh.tp > 1
            or self.mesh.pp > 1
            or self.plan.zero > 0
            or self.fsdp is not None
            or self.cp_model is not None
            or self.mesh.ep > 1
        )

    @property
    def pipelined(self) -> bool:
        return self.pipeline is not None

    @property
    def fp16_scaler_ok(self) -> bool:
        return not self.sharded

    # ---- a step ----------------------------------------------------------------------------------
    def forward_backward(
        self, tokens: Tensor, targets: Tensor, loss_fn: Callable, no_sync: bool = False
    ) -> float:
        """One micro-step on this rank's shard of the global batch: forward, loss, backward.
        Returns the loss averaged over the data-parallel (and context-parallel) ranks."""
        x, y = self.shard_batch(tokens, targets)
        if self.pipeline is not None:
            loss = self.pipeline.train_step(x, y, loss_fn)
            t = torch.tensor([loss], dtype=torch.float64, device=C.comm_device(self.dp_group))
        else:
            if no_sync and self.zero_optimizer is not None:
                raise ValueError(
                    "no_sync with ZeRO: ZeRO-2 reduce-scatters as gradients become ready; "
                    "accumulate by calling backward several times before step()"
                )
            ctx = (
                self.ddp.no_sync()
                if (no_sync and self.ddp is not None)
                else contextlib.nullcontext()
            )
            with ctx:
                logits = self.runner(x)
                if self.cp_model is not None:
                    y = self.cp_model.shard(y)
                loss_t = loss_fn(logits, y)
                loss_t.backward()
            t = loss_t.detach().double().reshape(1)
        C.all_reduce(t, self.dp_group, impl="torch")
        return float(t) / self.dp_size

    def pipeline_step(self, tokens: Tensor, targets: Tensor, loss_parts) -> Tensor:
        """pp > 1: forward and backward of ``plan.micro_batches`` micro-batches, stacked along B
        in ``tokens``/``targets`` (this dp rank's), through the pipeline schedule.
        ``loss_parts(logits, y) -> (ce, z)`` runs on the last stage; each micro-batch's ce + z is
        scaled by 1/m (gradient accumulation). Returns [mean ce, mean z] over the micro-batches,
        the same on every rank of the pipeline (broadcast from the last stage)."""
        if self.pipeline is None:
            raise RuntimeError("pipeline_step needs a plan with pp > 1")
        return self.pipeline.train_parts(tokens, targets, loss_parts)

    # ---- gradient norm over every shard ------------------------------------------------------------
    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """The global L2 norm of the gradient over every shard. Squares are summed locally per
        kind, then: tensor-parallel (and native DTensor) shards over their group; ZeRO-1/2/3
        shards over dp (their gradients are reduce-scattered onto the shards first); pipeline
        stages over pp (the tied W_e copy on the last stage counted once). Replicated gradients
        count once."""
        return self._norm(self._grad_items())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> Tensor:
        """Scale every gradient (shard) by min(1, max_norm / (‖g‖ + eps)) with ‖g‖ = ``grad_norm()``;
        returns ‖g‖ before clipping (left alone when it is not finite)."""
        if not (max_norm > 0):
            raise ValueError(f"max_norm={max_norm!r} must be > 0")
        items = self._grad_items()
        total = self._norm(items)
        if not torch.isfinite(total):
            return total
        coef = max_norm / (float(total) + eps)
        if coef < 1.0:
            for g, _, _ in items:
                if g is not None:
                    g.mul_(coef)
        return total

    def _norm(self, items: list[GradItem]) -> Tensor:
        sq: dict[str | None, float] = {}
        for g, axis, counted in items:
            if g is None or not counted:
                continue
            local = g.to_local() if hasattr(g, "to_local") else g
            sq[axis] = sq.get(axis, 0.0) + float(local.detach().float().pow(2).sum())
        total = sq.pop(None, 0.0)
        # every rank joins the same collectives in the same order: one per split axis
        for axis in self._split_axes():
            group = self.dp_group if axis == "dp" else self.mesh.group(axis)
            total += self._sum(sq.get(axis, 0.0), group)
        if self.zero_optimizer is not None or self.fsdp is not None:  # ZeRO: shards over dp
            total = self._sum(total, self.dp_group)
        if self.pipeline is not None and self.mesh.pp > 1:  # stages hold disjoint parameters
            total = self._sum(total, self.mesh.group("pp"))
        return torch.tensor(math.sqrt(total))

    @staticmethod
    def _sum(value: float, group) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=C.comm_device(group))
        C.all_reduce(t, group, impl="torch")
        return float(t[0])

    def _stage_copy_id(self) -> int | None:
        """id of the last stage's copy of a tied W_e (counted on the first stage), or None."""
        copy = getattr(self.pipeline, "tied_copy", None)
        return id(copy) if copy is not None else None

    # ---- state dicts -------------------------------------------------------------------------------
    def full_state_dict(self, all_stages: bool = False) -> dict[str, Tensor]:
        """Unsharded parameters under the single-process names. A collective over the tp/dp
        groups that hold shards. Pipeline: this stage's only, or with ``all_stages`` every stage's
        gathered on the first rank of the pipeline that holds global rank 0 (others get theirs)."""
        sd = self._full_state_dict()
        if not all_stages or self.pipeline is None or self.mesh.pp == 1:
            return sd
        me = dist.get_rank()
        pp_ranks = self.mesh.ranks("pp")
        if 0 not in pp_ranks:
            return sd
        got = [None] * len(pp_ranks) if me == pp_ranks[0] else None
        dist.gather_object(
            {k: v.detach().cpu() for k, v in sd.items()},
            got,
            dst=pp_ranks[0],
            group=self.mesh.group("pp"),
        )
        if me != pp_ranks[0]:
            return sd
        out = {}
        for part in got:
            out.update(part)
        return out

    def local_state_dict(self) -> dict[str, Tensor]:
        """This rank's parameters and buffers as they are sharded (names of the wrapped runner;
        DTensors as their local pieces): what a sharded checkpoint stores per rank."""
        out = {}
        for k, v in self.runner.state_dict(keep_vars=False).items():
            if hasattr(v, "to_local"):
                v = v.to_local()
            out[k] = v.detach()
        return out

    @torch.no_grad()
    def load_local_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Copy ``local_state_dict()`` tensors back in place (same plan and world size)."""
        own = self.runner.state_dict(keep_vars=True)
        missing, extra = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
        if missing or extra:
            raise ValueError(
                f"rank shard does not fit this plan's model: missing {missing[:5]}, "
                f"unexpected {extra[:5]}"
            )
        for k, t in own.items():
            dst = t.to_local() if hasattr(t, "to_local") else t
            if tuple(dst.shape) != tuple(sd[k].shape):
                raise ValueError(
                    f"rank shard: {k} has shape {tuple(sd[k].shape)}, this rank holds "
                    f"{tuple(dst.shape)}"
                )
            dst.copy_(sd[k].to(dst.device, dst.dtype))
