"""``parallelize(model, plan)``: one entry point that applies the strategies in a fixed order.

Seed 001 "混合并行" (3D/4D): model parallelism (TP/SP/CP/EP) inside a node, pipeline stages
across nodes, data parallelism replicating the unit; seed 000 §6.1 (DP scales throughput, TP/PP
model memory, SP/CP activation memory). Order applied here:

    1. tensor parallel (+ sequence parallel) over the tp axis      (replaces linears/embedding)
    2. context parallel over the cp axis                           (replaces attention)
    3. pipeline stages over the pp axis                            (keeps this rank's layers)
    4. data parallel over dp (× cp): DDP, ZeRO-1/2 (optimizer) or ZeRO-3 (FullyShard)

The model code is never touched; the returned ``ParallelModel`` has one training interface for
every combination: ``loss = pm.forward_backward(tokens, targets, loss_fn)``, then
``pm.optimizer.step()``. ``plan`` is a ``ParallelPlan``, a dict (``{"dp": 2, "tp": 2, "zero": 1}``,
the TOML/JSON ``parallel`` table) or a string (``"dp=2,tp=2,zero=1"``, ``"ddp"``, ``"zero3"``).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lmstack.parallel import collectives as C
from lmstack.parallel.mesh import DeviceMesh


@dataclass
class ParallelPlan:
    dp: int | None = None  # None: the world size divided by tp·pp·cp
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
    param_dtype: str = "fp32"  # ZeRO-3 compute dtype of gathered parameters (bf16 = mixed precision)
    backend: str = "lmstack"  # lmstack | native (torch DDP / fully_shard / DTensor)

    def __post_init__(self):
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero!r}; expected 0, 1, 2 or 3")
        if self.backend not in ("lmstack", "native"):
            raise ValueError(f"backend={self.backend!r}; expected 'lmstack' or 'native'")
        if self.param_dtype not in ("fp32", "bf16"):
            raise ValueError(f"param_dtype={self.param_dtype!r}; expected 'fp32' or 'bf16'")
        if self.zero == 3 and self.pp > 1:
            raise ValueError("zero=3 with pp>1 is not supported: shard the pipeline stages with zero=1 or 2")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True needs tp > 1 (it splits S across the tp ranks)")
        if self.sequence_parallel and self.cp > 1:
            raise ValueError("sequence_parallel with cp > 1 is not supported (both split S)")
        if self.pp > 1 and self.cp > 1:
            raise ValueError("pp > 1 with cp > 1 is not supported")
        if self.pp > 1 and self.tp > 1 and self.schedule == "zb":
            raise ValueError("schedule='zb' with tp > 1 is not supported (the W/B split would bypass the row-parallel "
                             "all-reduce); use 1f1b or gpipe")
        if self.pp > 1 and self.sequence_parallel:
            raise ValueError("pp > 1 with sequence_parallel is not supported (stages exchange full-S activations)")

    @classmethod
    def parse(cls, spec) -> "ParallelPlan":
        if isinstance(spec, ParallelPlan):
            return spec
        if spec is None:
            return cls()
        if isinstance(spec, str):
            names = {"ddp": {}, "ddp_naive": {"ddp_mode": "naive"}, "zero1": {"zero": 1}, "zero2": {"zero": 2},
                     "zero3": {"zero": 3}, "fsdp": {"zero": 3}}
            if spec in names:
                return cls(**names[spec])
            d = {}
            for part in spec.replace(" ", "").split(","):
                if not part:
                    continue
                if "=" not in part:
                    raise ValueError(f"parallel plan {spec!r}: expected name=value pairs or one of {sorted(names)}")
                k, v = part.split("=", 1)
                d[k] = v
            spec = d
        if not isinstance(spec, dict):
            raise ValueError(f"parallel plan must be a dict, string or ParallelPlan, got {type(spec).__name__}")
        known = {f.name: f for f in fields(cls)}
        out = {}
        for k, v in spec.items():
            if k not in known:
                raise ValueError(f"parallel plan: unknown key {k!r}; expected one of {sorted(known)}")
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
        raise RuntimeError("torch.distributed environment not found (RANK/WORLD_SIZE): launch with "
                           "`torchrun --nproc_per_node=N -m lmstack train ...`")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


class ParallelModel(nn.Module):
    """The result of ``parallelize``: this rank's part of the model plus the data layout."""

    def __init__(self, model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh):
        super().__init__()
        self.plan, self.mesh = plan, mesh
        self.model = model  # the (possibly modified) original Transformer
        self.tp_model = None
        self.cp_model = None
        self.pipeline = None
        self.ddp = None
        self.fsdp = None
        self.native = None
        self.zero_optimizer = None
        self.dp_group = mesh.group("dp_cp") if mesh.cp > 1 else mesh.group("dp")
        self.dp_size = mesh.dp * mesh.cp
        self.runner: nn.Module = model
        self._pipe_loss = None

    # ---- data layout ---------------------------------------------------------------------------
    def shard_batch(self, tokens: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """The global batch (B, S) -> this rank's part: B split over dp; S over cp (done inside the
        cp wrapper for tokens, here for targets). TP and PP ranks of one replica see the same rows."""
        B = tokens.shape[0]
        if B % self.mesh.dp:
            raise ValueError(f"global batch B={B} is not divisible by dp={self.mesh.dp}")
        r = self.mesh.rank("dp")
        tokens, targets = tokens.chunk(self.mesh.dp)[r], targets.chunk(self.mesh.dp)[r]
        return tokens, targets

    def forward(self, tokens: Tensor, *args, **kwargs) -> Tensor:
        if self.pipeline is not None:
            raise RuntimeError("a pipeline-parallel model runs forward and backward together: use forward_backward")
        return self.runner(tokens, *args, **kwargs)

    def forward_backward(self, tokens: Tensor, targets: Tensor, loss_fn, no_sync: bool = False) -> float:
        """One micro-step on this rank's shard of the global batch: forward, loss, backward.
        Returns the loss averaged over the data-parallel (and context-parallel) ranks."""
        x, y = self.shard_batch(tokens, targets)
        if self.pipeline is not None:
            loss = self.pipeline.train_step(x, y, loss_fn)
            t = torch.tensor([loss], dtype=torch.float64, device=C.comm_device(self.dp_group))
        else:
            ctx = self.ddp.no_sync() if (no_sync and self.ddp is not None) else contextlib.nullcontext()
            if no_sync and self.zero_optimizer is not None:
                raise ValueError("no_sync with ZeRO: ZeRO-2 reduce-scatters as gradients become ready; "
                                 "accumulate by calling backward several times before step()")
            with ctx:
                logits = self.runner(x)
                if self.cp_model is not None:
                    y = self.cp_model.shard(y)
                loss_t = loss_fn(logits, y)
                loss_t.backward()
            t = loss_t.detach().double().reshape(1)
        C.all_reduce(t, self.dp_group, impl="torch")
        return float(t) / self.dp_size

    def build_optimizer(self, optimizer_class: type, params=None, **kwargs):
        """The optimizer over this rank's parameters; ZeRO-1/2 wrap it (states sharded over dp).
        ``params``: this rank's parameters or param groups (e.g. weight-decay groups); default all
        trainable ones."""
        if params is None:
            params = [p for p in self.parameters() if p.requires_grad]
        if self.plan.zero in (1, 2):
            from lmstack.parallel.zero import ZeroOptimizer

            self.zero_optimizer = ZeroOptimizer(params, optimizer_class, self.dp_group, self.plan.zero, **kwargs)
            return self.zero_optimizer
        return optimizer_class(params, **kwargs)

    @property
    def sharded(self) -> bool:
        """Whether a rank's model is not the plain single-process one: it holds only part of the
        parameters or optimizer states (tp, pp, ZeRO), or its modules were replaced (cp's ring
        attention). The full parameters then come from ``full_state_dict()``."""
        return (self.mesh.tp > 1 or self.mesh.pp > 1 or self.plan.zero > 0 or self.fsdp is not None
                or self.cp_model is not None)

    # ---- trainer seams: batches, pipeline steps ---------------------------------------------------
    def local_batch(self, batch):
        """A batch the trainer sampled for this data-parallel rank -> what this rank computes on:
        under context parallelism the targets of this rank's sequence chunks (the inputs stay
        whole: the cp wrapper picks its tokens). Packing (document ids) is refused under cp and pp."""
        if (self.cp_model is not None or self.pipeline is not None) and batch.document_ids is not None:
            axis = "cp" if self.cp_model is not None else "pp"
            raise ValueError(f"packing (document ids) is not supported with {axis} > 1: set packing = false")
        if self.cp_model is None:
            return batch
        return type(batch)(batch.x, self.cp_model.shard(batch.y), batch.positions, batch.document_ids)

    def pipeline_step(self, tokens: Tensor, targets: Tensor, loss_parts) -> Tensor:
        """pp > 1: forward and backward of ``plan.micro_batches`` micro-batches, stacked along B
        in ``tokens``/``targets`` (this dp rank's), through the pipeline schedule.
        ``loss_parts(logits, y) -> (ce, z)`` runs on the last stage; each micro-batch's ce + z is
        scaled by 1/m (gradient accumulation). Returns [mean ce, mean z] over the micro-batches,
        the same on every rank of the pipeline (broadcast from the last stage)."""
        if self.pipeline is None:
            raise RuntimeError("pipeline_step needs a plan with pp > 1")
        parts: list[Tensor] = []
        if self._pipe_loss is None:  # one function object for every step (torch's schedules cache it)
            state = {}

            def loss_fn(logits, y):
                ce, z = state["parts_fn"](logits, y)
                state["parts"].append(torch.stack([ce.detach().double(), z.detach().double()]))
                return ce + z

            self._pipe_loss = (loss_fn, state)
        loss_fn, state = self._pipe_loss
        state["parts_fn"], state["parts"] = loss_parts, parts
        self.pipeline.train_step(tokens, targets, loss_fn)
        group, ranks = self.mesh.group("pp"), self.mesh.ranks("pp")
        dev = C.comm_device(group)
        # torch's schedules may run the loss once more on their first step (shape inference): keep the last m
        parts = [t for t in parts if t.device.type != "meta"][-self.plan.micro_batches:]
        out = (torch.stack(parts).mean(0) if parts else torch.zeros(2, dtype=torch.float64)).to(dev)
        dist.broadcast(out, ranks[-1], group=group)
        return out.cpu()

    # ---- gradient norm over every shard ------------------------------------------------------------
    def _grad_items(self) -> list[tuple[Tensor | None, object, bool]]:
        """(gradient, split, counted) for every gradient this rank holds: ``split`` is None for
        a replicated gradient (counted once), or the axis whose ranks hold the other pieces of the
        same tensor ("tp" for tensor-parallel shards, "dp" for native FSDP shards); ``counted`` is
        False for a copy counted elsewhere (the last stage's tied W_e)."""
        tp_group = "tp" if self.mesh.tp > 1 else None
        tp_ids = _tp_sharded_ids(self.model) if self.tp_model is not None else set()
        copy_id = id(self.pipeline.stage.unembed) if (self.pipeline is not None and
                                                       getattr(self.pipeline.stage, "unembed", None) is not None) \
            else None
        items = []
        if self.zero_optimizer is not None:
            self.zero_optimizer.reduce_gradients()
            for p, g in self.zero_optimizer.shard_grads():
                items.append((g, tp_group if id(p) in tp_ids else None, id(p) != copy_id))
        elif self.fsdp is not None:
            for sh in self.fsdp.shards:
                key = self.fsdp.shard_keys.get(id(sh))
                split = isinstance(key, tuple) and key[1]
                items.append((sh.grad, tp_group if split else None, True))
        else:
            seen = set()
            for p in self.runner.parameters():
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                g, red = p.grad, (tp_group if id(p) in tp_ids else None)
                if g is not None and hasattr(g, "to_local"):  # native DTensor: Shard placements are split
                    from torch.distributed.tensor import Shard

                    sharded = any(isinstance(pl, Shard) for pl in g.placements)
                    red = ("tp" if self.mesh.tp > 1 else "dp") if sharded else None
                items.append((g, red, id(p) != copy_id))
        return items

    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """The global L2 norm of the gradient over every shard. Squares are summed locally per
        kind, then: tensor-parallel (and native DTensor) shards over their group; ZeRO-1/2/3
        shards over dp (their gradients are reduce-scattered onto the shards first); pipeline
        stages over pp (the tied W_e copy on the last stage counted once). Replicated gradients
        count once."""
        return self._norm(self._grad_items())

    def _norm(self, items) -> Tensor:
        sq: dict[object, float] = {}
        for g, red, counted in items:
            if g is None or not counted:
                continue
            local = g.to_local() if hasattr(g, "to_local") else g
            sq[red] = sq.get(red, 0.0) + float(local.detach().float().pow(2).sum())
        total = sq.pop(None, 0.0)
        # every rank joins the same collectives in the same order: one per group kind
        for axis in self._split_axes():
            group = self.dp_group if axis == "dp" else self.mesh.group(axis)
            t = torch.tensor([sq.get(axis, 0.0)], dtype=torch.float64, device=C.comm_device(group))
            C.all_reduce(t, group, impl="torch")
            total += float(t[0])
        if self.zero_optimizer is not None or self.fsdp is not None:  # ZeRO: shards over dp
            t = torch.tensor([total], dtype=torch.float64, device=C.comm_device(self.dp_group))
            C.all_reduce(t, self.dp_group, impl="torch")
            total = float(t[0])
        if self.pipeline is not None and self.mesh.pp > 1:  # stages hold disjoint parameters
            t = torch.tensor([total], dtype=torch.float64, device=C.comm_device(self.mesh.group("pp")))
            C.all_reduce(t, self.mesh.group("pp"), impl="torch")
            total = float(t[0])
        return torch.tensor(math.sqrt(total))

    def _split_axes(self) -> list[str]:
        """The axes over which split gradients are summed, the same list on every rank."""
        if self.native is not None and self.plan.zero == 3:
            return ["dp"]
        return ["tp"] if self.mesh.tp > 1 else []

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
        dist.gather_object({k: v.detach().cpu() for k, v in sd.items()}, got, dst=pp_ranks[0],
                           group=self.mesh.group("pp"))
        if me != pp_ranks[0]:
            return sd
        out = {}
        for part in got:
            out.update(part)
        return out

    def _full_state_dict(self) -> dict[str, Tensor]:
        from lmstack.parallel.tensor import gather_tp_state_dict

        if self.native is not None:
            from lmstack.parallel.native import native_full_state_dict

            return native_full_state_dict(self)
        if self.fsdp is not None:
            sd = self.fsdp.full_state_dict()
            if self.tp_model is not None:  # ZeRO-3 over TP shards: undo the TP split too
                sd = _tp_gather_named(self.model, sd, self.mesh.group("tp"))
            return {_clean(k): v for k, v in sd.items()}
        if self.tp_model is not None:
            only = {id(p) for p in self.pipeline.stage.parameters()} if self.pipeline is not None else None
            return gather_tp_state_dict(self.model, self.mesh.group("tp"), only)
        if self.pipeline is not None:
            mine = {id(p) for p in self.pipeline.stage.parameters()}
            return {_clean(n): p.detach() for n, p in self.model.named_parameters() if id(p) in mine}
        return {_clean(n): p.detach() for n, p in self.model.named_parameters()}

    # ---- this rank's state (sharded checkpoints) --------------------------------------------------
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
            raise ValueError(f"rank shard does not fit this plan's model: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
        for k, t in own.items():
            dst = t.to_local() if hasattr(t, "to_local") else t
            if tuple(dst.shape) != tuple(sd[k].shape):
                raise ValueError(f"rank shard: {k} has shape {tuple(sd[k].shape)}, this rank holds "
                                 f"{tuple(dst.shape)}")
            dst.copy_(sd[k].to(dst.device, dst.dtype))


def _tp_sharded_ids(model: nn.Module) -> set[int]:
    """ids of the parameters split across the tp ranks (the rest are replicated)."""
    from lmstack.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    out = set()
    for mod in model.modules():
        if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
            out.update(id(p) for p in (getattr(mod, "weight", None), getattr(mod, "bias", None)) if p is not None)
        elif isinstance(mod, RowParallelLinear):
            out.add(id(mod.weight))
    return out


def _clean(name: str) -> str:
    return name.replace(".inner.", ".")


def _tp_gather_named(model: nn.Module, sd: dict[str, Tensor], group) -> dict[str, Tensor]:
    from lmstack.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    kinds = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
            kinds[f"{name}.weight"] = 0
            kinds[f"{name}.bias"] = 0
        elif isinstance(mod, RowParallelLinear):
            kinds[f"{name}.weight"] = 1
    out = {}
    for k, v in sd.items():
        if k in kinds:
            v = C.all_gather_dim(v.contiguous(), kinds[k], group)
        out[k.replace("_norm.norm.", "_norm.").replace("norm.norm.", "norm.")] = v
    return out


def parallelize(model: nn.Module, plan=None, mesh: DeviceMesh | None = None) -> ParallelModel:
    """Apply ``plan`` to a ``lmstack.model.Transformer`` (built identically on every rank)."""
    plan = ParallelPlan.parse(plan)
    if mesh is None:
        mesh = DeviceMesh.build(dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp, ep=plan.ep)
    if plan.backend == "native":
        from lmstack.parallel.native import native_parallelize

        return native_parallelize(model, plan, mesh)
    pm = ParallelModel(model, plan, mesh)
    runner: nn.Module = model
    # 1. tensor (+ sequence) parallel
    if mesh.tp > 1:
        from lmstack.parallel.tensor import TensorParallel

        pm.tp_model = TensorParallel(model, mesh.group("tp"), plan.sequence_parallel, gather_output=True)
        runner = pm.tp_model
    # 2. context parallel
    if mesh.cp > 1:
        from lmstack.parallel.context import ContextParallel

        pm.cp_model = ContextParallel(model, mesh.group("cp"))
        if pm.tp_model is not None:  # TP outside (gathers V), CP inside (picks this rank's tokens)
            pm.tp_model.module = pm.cp_model
            runner = pm.tp_model
        else:
            runner = pm.cp_model
    # 3. pipeline
    if mesh.pp > 1:
        if plan.sequence_parallel:
            raise ValueError("pp > 1 with sequence_parallel is not supported (stages exchange full-S activations)")
        from lmstack.parallel.pipeline import PipelineParallel, tied_embedding_groups

        tied = tied_embedding_groups(mesh)
        dp_group = mesh.group("dp") if plan.zero == 0 else None
        pm.pipeline = PipelineParallel(model, mesh.group("pp"), plan.micro_batches, plan.schedule,
                                       dp_group=dp_group, tied_group=tied,
                                       vocab_group=mesh.group("tp") if mesh.tp > 1 else None)
        if plan.zero in (1, 2):
            pm.pipeline.dp_group = None  # the ZeRO optimizer reduce-scatters instead
        runner = pm.pipeline
        pm.pipeline.stage.train()
    # 4. data parallel over dp (× cp)
    if pm.dp_size > 1 or plan.zero == 3:
        if plan.zero == 3:
            from lmstack.parallel.zero import FullyShard

            dtype = torch.bfloat16 if plan.param_dtype == "bf16" else torch.float32
            tp_ids = _tp_sharded_ids(model) if pm.tp_model is not None else set()
            # flat shards per (matrix?, split over tp?): weight decay and the gradient norm tell them apart
            pm.fsdp = FullyShard(runner if mesh.tp == 1 and mesh.cp == 1 else model, pm.dp_group,
                                 param_dtype=dtype, segment_key=lambda p: (p.dim() >= 2, id(p) in tp_ids))
            if mesh.tp == 1 and mesh.cp == 1:
                runner = pm.fsdp
            else:
                # shard the inner model, keep the TP/CP wrapper outside: it calls the model module
                inner = pm.fsdp
                wrapper = runner
                wrapper.module = inner
                runner = wrapper
        elif pm.pipeline is None and plan.zero == 0:
            from lmstack.parallel.ddp import DataParallel

            pm.ddp = DataParallel(runner, pm.dp_group, mode=plan.ddp_mode, bucket_mb=plan.bucket_mb)
            runner = pm.ddp
        elif plan.zero in (1, 2):
            from lmstack.parallel.ddp import broadcast_module

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
        if p.pp > 1 and trainer is not None:  # the pipeline's micro-batches are the accumulation steps
            from dataclasses import replace

            p = replace(p, micro_batches=trainer.config.grad_accum)
        pm = parallelize(model, p)
        if trainer is not None:
            trainer.parallel_model = pm
        return pm.runner

    return apply
