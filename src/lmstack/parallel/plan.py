"""``parallelize(model, plan)``: one entry point that applies the strategies in a fixed order.

CS336 notes "混合并行" (3D/4D): model parallelism (TP/SP/CP/EP) inside a node, pipeline stages
across nodes, data parallelism replicating the unit; Book of LLMs §6.1 (DP scales throughput, TP/PP
model memory, SP/CP activation memory). Order applied here:

    0. expert parallel over the ep axis                            (replaces the MoE layers)
    1. tensor parallel (+ sequence parallel) over the tp axis      (replaces linears/embedding)
    2. context parallel over the cp axis                           (replaces attention)
    3. pipeline stages over the pp axis                            (keeps this rank's layers)
    4. data parallel over dp (× cp): DDP, ZeRO-1/2 (optimizer) or ZeRO-3 (FullyShard)

With ``ep`` > 1 the world is dp·ep (·tp·pp·cp) ranks: each MoE layer's experts are split over the
ep ranks of a group, every other parameter is replicated over all dp·ep ranks, and the batch is
split over all of them (``mesh.dp = dp·ep``). EP composes with DDP, ZeRO-1/2 and TP (which then
shards the attention; the MoE layers run whole on each tp rank); a plan with ep and sequence
parallelism, pp, cp, zero=3 or backend="native" is refused (not implemented).

The model code is never touched; the returned wrapper (``ParallelModel``, or
``NativeParallelModel`` for ``backend="native"``) has one interface for every combination,
``interface.ParallelWrapper``: ``loss = pm.forward_backward(tokens, targets, loss_fn)``, then the
optimizer's step. ``plan`` is a ``ParallelPlan``, a dict (``{"dp": 2, "tp": 2, "zero": 1}``,
the TOML/JSON ``parallel`` table) or a string (``"dp=2,tp=2,zero=1"``, ``"ddp"``, ``"zero3"``).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lmstack.parallel.context import ContextParallel
from lmstack.parallel.ddp import DataParallel, broadcast_module
from lmstack.parallel.expert import (
    ExpertDataParallel,
    broadcast_expert_parallel,
    gather_experts,
    shard_experts,
)
from lmstack.parallel.interface import GradItem, ParallelWrapper, WrapperBase
from lmstack.parallel.mesh import DeviceMesh
from lmstack.parallel.native import NativeParallelModel
from lmstack.parallel.pipeline import PipelineParallel, tied_embedding_groups
from lmstack.parallel.tensor import (
    TensorParallel,
    gather_tp_named,
    gather_tp_state_dict,
    single_process_name,
    tp_sharded_ids,
)
from lmstack.parallel.zero import FullyShard, ZeroOptimizer
from lmstack.utils import torch_dtype


@dataclass
class ParallelPlan:
    dp: int | None = None  # None: the world size divided by ep·tp·pp·cp
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0  # 0 DDP, 1/2 sharded optimizer (+grads), 3 FSDP
    sequence_parallel: bool = False
    ddp_mode: str = "bucketed"  # or "naive"
    bucket_mb: float = 25.0
    micro_batches: int = 4  # pipeline m
    schedule: str = "1f1b"  # gpipe | 1f1b | zb
    param_dtype: str = (
        "fp32"  # ZeRO-3 compute dtype of gathered parameters (bf16 = mixed precision)
    )
    backend: str = "lmstack"  # lmstack | native (torch DDP / fully_shard / DTensor)

    def __post_init__(self):
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero!r}; expected 0, 1, 2 or 3")
        if self.backend not in ("lmstack", "native"):
            raise ValueError(f"backend={self.backend!r}; expected 'lmstack' or 'native'")
        if self.param_dtype not in ("fp32", "bf16"):
            raise ValueError(f"param_dtype={self.param_dtype!r}; expected 'fp32' or 'bf16'")
        if self.zero == 3 and self.pp > 1:
            raise ValueError(
                "zero=3 with pp>1 is not supported: shard the pipeline stages with zero=1 or 2"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "sequence_parallel=True needs tp > 1 (it splits S across the tp ranks)"
            )
        if self.sequence_parallel and self.cp > 1:
            raise ValueError("sequence_parallel with cp > 1 is not supported (both split S)")
        if self.pp > 1 and self.cp > 1:
            raise ValueError("pp > 1 with cp > 1 is not supported")
        if self.pp > 1 and self.tp > 1 and self.schedule == "zb":
            raise ValueError(
                "schedule='zb' with tp > 1 is not supported (the W/B split would bypass the row-parallel "
                "all-reduce); use 1f1b or gpipe"
            )
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep={self.ep!r} must be an integer >= 1")
        if self.ep > 1:
            others = {
                "sequence_parallel": self.sequence_parallel,
                "pp": self.pp > 1,
                "cp": self.cp > 1,
                "zero=3": self.zero == 3,
                "backend='native'": self.backend == "native",
            }
            bad = [k for k, v in others.items() if v]
            if bad:
                raise ValueError(
                    f"ep={self.ep} with {', '.join(bad)} is not supported: expert parallelism composes "
                    "with dp, zero=1/2 and tp (for the attention) only"
                )
        if self.pp > 1 and self.sequence_parallel:
            raise ValueError(
                "pp > 1 with sequence_parallel is not supported (stages exchange full-S activations)"
            )

    @classmethod
    def parse(cls, spec) -> ParallelPlan:
        if isinstance(spec, ParallelPlan):
            return spec
        if spec is None:
            return cls()
        if isinstance(spec, str):
            names = {
                "ddp": {},
                "ddp_naive": {"ddp_mode": "naive"},
                "zero1": {"zero": 1},
                "zero2": {"zero": 2},
                "zero3": {"zero": 3},
                "fsdp": {"zero": 3},
            }
            if spec in names:
                return cls(**names[spec])
            d = {}
            for part in spec.replace(" ", "").split(","):
                if not part:
                    continue
                if "=" not in part:
                    raise ValueError(
                        f"parallel plan {spec!r}: expected name=value pairs or one of {sorted(names)}"
                    )
                k, v = part.split("=", 1)
                d[k] = v
            spec = d
        if not isinstance(spec, dict):
            raise ValueError(
                f"parallel plan must be a dict, string or ParallelPlan, got {type(spec).__name__}"
            )
        known = {f.name: f for f in fields(cls)}
        out = {}
        for k, v in spec.items():
            if k not in known:
                raise ValueError(
                    f"parallel plan: unknown key {k!r}; expected one of {sorted(known)}"
                )
            if isinstance(v, str):
                low = v.lower()
                if low in ("true", "false"):
                    v = low == "true"
                else:
                    try:
                        v = int(v)
                    except ValueError:
                        try:
                            v = float(v)
                        except ValueError:
                            pass
            out[k] = v
        return cls(**out)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT): NCCL when CUDA is available, gloo otherwise. No-op if already initialised.

    ``timeout_s`` bounds every collective: a rank that waits longer for a stalled peer raises
    (gloo) or has its communicator aborted by NCCL's watchdog, so the job ends instead of hanging
    (docs/parallel.md, "A stalled rank"). ``lmstack train`` sets it from ``dist_timeout_s``."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be a number of seconds > 0")
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "torch.distributed environment not found (RANK/WORLD_SIZE): launch with "
            "`torchrun --nproc_per_node=N -m lmstack train ...`"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


class ParallelModel(WrapperBase, nn.Module):
    """The result of ``parallelize`` with lmstack's strategies: this rank's part of the model plus
    the data layout; implements ``ParallelWrapper`` (``lmstack.parallel.interface``)."""

    def __init__(self, model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh):
        super().__init__()
        self.plan, self.mesh = plan, mesh
        self.model = model  # the original Transformer (tp/cp/pp replace or share its submodules)
        self.tp_model = None
        self.cp_model = None
        self.pipeline = None
        self.ddp = None
        self.fsdp = None
        self.zero_optimizer = None
        self.dp_group = mesh.group("dp_cp") if mesh.cp > 1 else mesh.group("dp")
        self.dp_size = mesh.dp * mesh.cp
        self.runner: nn.Module = model
        self.expert_params: list[nn.Parameter] = []  # ep > 1: this rank's expert shards

    def forward(self, tokens: Tensor, *args, **kwargs) -> Tensor:
        if self.pipeline is not None and torch.is_grad_enabled():
            raise RuntimeError(
                "a pipeline-parallel model runs forward and backward together: use forward_backward"
            )
        return self.runner(tokens, *args, **kwargs)

    def build_optimizer(self, optimizer_class: type, params=None, **kwargs):
        """The optimizer over this rank's parameters; ZeRO-1/2 wrap it (states sharded over dp).
        ``params``: this rank's parameters or param groups (e.g. weight-decay groups); default all
        trainable ones."""
        if params is None:
            params = [p for p in self.parameters() if p.requires_grad]
        if self.plan.zero in (1, 2):
            # experts differ per ep rank: their states are sharded over the ranks holding the same ones
            edp = {id(p): self.mesh.group("edp") for p in self.expert_params}
            self.zero_optimizer = ZeroOptimizer(
                params, optimizer_class, self.dp_group, self.plan.zero, shard_groups=edp, **kwargs
            )
            return self.zero_optimizer
        return optimizer_class(params, **kwargs)

    def _grad_items(self) -> list[GradItem]:
        """(gradient, split, counted) for every gradient this rank holds: ``split`` is None for
        a replicated gradient (counted once), or "tp" for the pieces of a tensor-parallel shard;
        ``counted`` is False for a copy counted elsewhere (the last stage's tied W_e)."""
        tp_axis = "tp" if self.mesh.tp > 1 else None
        tp_ids = tp_sharded_ids(self.model) if self.tp_model is not None else set()
        ep_ids = {id(p) for p in self.expert_params}
        copy_id = self._stage_copy_id()
        items = []
        if self.zero_optimizer is not None:
            self.zero_optimizer.reduce_gradients()
            for p, g in self.zero_optimizer.shard_grads():
                items.append((g, tp_axis if id(p) in tp_ids else None, id(p) != copy_id))
        elif self.fsdp is not None:
            for sh in self.fsdp.shards:
                key = self.fsdp.shard_keys.get(id(sh))
                split = isinstance(key, tuple) and key[1]
                items.append((sh.grad, tp_axis if split else None, True))
        else:
            for p in (
                self.runner.parameters()
            ):  # once each; expert shards differ over ep (ZeRO: over dp, above)
                if p.requires_grad:
                    axis = "ep" if id(p) in ep_ids else (tp_axis if id(p) in tp_ids else None)
                    items.append((p.grad, axis, id(p) != copy_id))
        return items

    def _split_axes(self) -> list[str]:
        """The axes over which split gradients are summed, the same list on every rank."""
        axes = ["tp"] if self.mesh.tp > 1 else []
        if self.mesh.ep > 1 and self.zero_optimizer is None:
            axes.append("ep")
        return axes

    def _full_state_dict(self) -> dict[str, Tensor]:
        if self.fsdp is not None:
            sd = self.fsdp.full_state_dict()
            if self.tp_model is not None:  # ZeRO-3 over TP shards: undo the TP split too
                sd = gather_tp_named(self.model, sd, self.mesh.group("tp"))
            return {single_process_name(k): v for k, v in sd.items()}
        only = (
            {id(p) for p in self.pipeline.stage.parameters()} if self.pipeline is not None else None
        )
        if self.tp_model is not None:
            sd = gather_tp_state_dict(self.model, self.mesh.group("tp"), only)
        else:
            sd = {
                single_process_name(n): p.detach()
                for n, p in self.model.named_parameters()
                if only is None or id(p) in only
            }
        if self.mesh.ep > 1:  # each rank holds E/ep experts: gather the whole (E, ., .) tensors
            sd = gather_experts(self.model, sd, self.mesh.group("ep"))
        return sd


def build_mesh(plan: ParallelPlan) -> DeviceMesh:
    """The mesh of ``plan`` on this world. With ep > 1 the plan's dp counts the replicas of one expert
    shard and the mesh's data-parallel axis (which splits the batch) has dp·ep ranks."""
    if plan.ep == 1:
        return DeviceMesh.build(dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp)
    world = (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    )
    rest = plan.ep * plan.tp * plan.pp * plan.cp
    if plan.dp is None:
        if world % rest:
            raise ValueError(
                f"world size {world} is not divisible by ep·tp·pp·cp = "
                f"{plan.ep}·{plan.tp}·{plan.pp}·{plan.cp} = {rest}"
            )
        dp = world // rest
    else:
        dp = plan.dp
        if dp * rest != world:
            raise ValueError(
                f"world size {world} != dp·ep·tp·pp·cp = "
                f"{dp}·{plan.ep}·{plan.tp}·{plan.pp}·{plan.cp} = {dp * rest}"
            )
    return DeviceMesh.build(dp=dp * plan.ep, tp=plan.tp, pp=plan.pp, cp=plan.cp, ep=plan.ep)


def parallelize(model: nn.Module, plan=None, mesh: DeviceMesh | None = None) -> ParallelWrapper:
    """Apply ``plan`` to a ``lmstack.model.Transformer`` (built identically on every rank)."""
    plan = ParallelPlan.parse(plan)
    if mesh is None:
        mesh = build_mesh(plan)
    if plan.backend == "native":
        return NativeParallelModel(model, plan, mesh)
    pm = ParallelModel(model, plan, mesh)
    runner: nn.Module = model
    # 0. expert parallel: this rank keeps E/ep experts of each MoE layer
    if mesh.ep > 1:
        pm.expert_params = shard_experts(model, mesh.group("ep"), load_group=pm.dp_group)
    # 1. tensor (+ sequence) parallel
    if mesh.tp > 1:
        pm.tp_model = TensorParallel(
            model, mesh.group("tp"), plan.sequence_parallel, gather_output=True
        )
        runner = pm.tp_model
    # 2. context parallel
    if mesh.cp > 1:
        pm.cp_model = ContextParallel(model, mesh.group("cp"))
        if pm.tp_model is not None:  # TP outside (gathers V), CP inside (picks this rank's tokens)
            pm.tp_model.module = pm.cp_model
            runner = pm.tp_model
        else:
            runner = pm.cp_model
    # 3. pipeline
    if mesh.pp > 1:
        dp_group = mesh.group("dp") if plan.zero == 0 else None  # ZeRO-1/2 reduce-scatter instead
        pm.pipeline = PipelineParallel(
            model,
            mesh.group("pp"),
            plan.micro_batches,
            plan.schedule,
            dp_group=dp_group,
            tied_group=tied_embedding_groups(mesh),
            vocab_group=mesh.group("tp") if mesh.tp > 1 else None,
        )
        runner = pm.pipeline
        pm.pipeline.stage.train()
    # 4. data parallel over dp (× cp)
    if pm.dp_size > 1 or plan.zero == 3:
        if plan.zero == 3:
            dtype = torch_dtype(plan.param_dtype, allowed=("fp32", "bf16"), what="param_dtype")
            tp_ids = tp_sharded_ids(model) if pm.tp_model is not None else set()
            # flat shards per (matrix?, split over tp?): weight decay and the gradient norm tell them apart
            outer = mesh.tp == 1 and mesh.cp == 1
            pm.fsdp = FullyShard(
                runner if outer else model,
                pm.dp_group,
                param_dtype=dtype,
                segment_key=lambda p: (p.dim() >= 2, id(p) in tp_ids),
            )
            if outer:
                runner = pm.fsdp
            else:  # shard the inner model, keep the TP/CP wrapper outside: it calls the model module
                runner.module = pm.fsdp
        elif (
            mesh.ep > 1
        ):  # replicated grads averaged over dp·ep ranks, expert grads over their replicas
            if plan.zero == 0:
                pm.ddp = runner = ExpertDataParallel(
                    runner, pm.dp_group, mesh.group("edp"), pm.expert_params
                )
            else:  # ZeRO-1/2 reduce-scatter the gradients themselves (experts over edp: build_optimizer)
                broadcast_expert_parallel(model, pm.dp_group, mesh.group("edp"), pm.expert_params)
        elif pm.pipeline is None and plan.zero == 0:
            pm.ddp = DataParallel(runner, pm.dp_group, mode=plan.ddp_mode, bucket_mb=plan.bucket_mb)
            runner = pm.ddp
        elif plan.zero in (1, 2):
            broadcast_module(model, pm.dp_group)
    pm.runner = runner
    return pm


def get_parallelize(spec):
    """The trainer seam (``lmstack.train.Trainer.parallelize``): ``get_parallelize(config.parallel)``
    returns ``fn(trainer, model) -> model``. It initialises torch.distributed, applies the plan and
    sets ``trainer.parallel_model`` to the ``ParallelModel``; the trainer then seeds its sampler by
    the dp rank, builds its optimizer with ``pm.build_optimizer`` (ZeRO-1/2), hands each sampled
    batch to ``pm.local_batch`` (cp: this rank's targets), runs ``pm.pipeline_step`` in place of
    its micro-batch loop when pp > 1 (the micro-batches are the ``grad_accum`` steps), clips with
    ``pm.clip_grad_norm_`` and checkpoints through ``lmstack.parallel.checkpoint`` (per-rank shard
    files + the gathered full weights). Every plan ``parallelize`` accepts runs through it."""
    plan = ParallelPlan.parse(spec)

    def apply(trainer, model: nn.Module) -> nn.Module:
        init_distributed(timeout_s=trainer.config.dist_timeout_s if trainer is not None else 600.0)
        p = plan
        if (
            p.pp > 1 and trainer is not None
        ):  # the pipeline's micro-batches are the accumulation steps
            p = replace(p, micro_batches=trainer.config.grad_accum)
        pm = parallelize(model, p)
        if trainer is not None:
            trainer.parallel_model = pm
        return pm.runner

    return apply
