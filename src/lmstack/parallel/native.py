"""``backend="native"``: the same plans on PyTorch's production implementations.

- DDP        -> ``torch.nn.parallel.DistributedDataParallel`` (bucketed, overlapped; C++ reducer)
- ZeRO-3     -> FSDP2 ``torch.distributed.fsdp.fully_shard`` per block, then the root
               (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` for bf16)
- TP         -> DTensor ``distribute_module`` with torch's colwise/rowwise placements: q/k/v/gate/up
               Shard(0), o/down Shard(1) (embedding and unembedding stay replicated)
- ZeRO-1/2   -> ``torch.distributed.optim.ZeroRedundancyOptimizer`` (states sharded)
- PP         -> ``torch.distributed.pipelining``: lmstack's stage (the model's own class holding a slice
               of its layers) in torch's ``PipelineStage``,
               ``ScheduleGPipe`` / ``Schedule1F1B``

The tests train the same plan with both backends and compare losses and parameters, so the
hand-written strategies are checked against torch's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lmstack.parallel import collectives as C
from lmstack.parallel.interface import GradItem, WrapperBase
from lmstack.parallel.mesh import DeviceMesh
from lmstack.parallel.pipeline import PipelineParallel, tied_embedding_groups
from lmstack.parallel.tensor import check_divisible
from lmstack.utils import torch_dtype

# torch's fsdp / tensor / pipelining / optim packages take ~1 s to import: they are imported where
# used, so runs with backend="lmstack" (every torchrun rank) never pay for them.
SCHEDULES = ("gpipe", "1f1b")


def torch_mesh(group, name: str):
    """A 1-D torch DeviceMesh over ``group``'s ranks."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    return TorchMesh.from_group(
        group, "cuda" if torch.cuda.is_available() else "cpu", mesh_dim_names=(name,)
    )


class NativeParallelModel(WrapperBase):
    """``parallelize(model, plan)`` with ``backend="native"``: implements ``ParallelWrapper``
    (``lmstack.parallel.interface``) on torch's DDP, FSDP2, DTensor, ZeroRedundancyOptimizer and
    pipelining."""

    def __init__(self, model: nn.Module, plan, mesh: DeviceMesh):
        if mesh.cp > 1:
            raise ValueError(
                "backend='native' covers dp, zero, tp and pp; use backend='lmstack' for cp"
            )
        if mesh.pp > 1 and (mesh.tp > 1 or plan.zero != 0):
            raise ValueError(
                "backend='native' pp composes only with plain dp here; use backend='lmstack'"
            )
        if plan.zero == 3 and mesh.tp > 1:
            raise ValueError(
                "backend='native' zero=3 with tp>1 needs a 2-D torch mesh; use backend='lmstack'"
            )
        self.plan, self.mesh, self.model = plan, mesh, model
        self.tp_model = self.cp_model = self.pipeline = self.ddp = self.fsdp = (
            self.zero_optimizer
        ) = None
        self.dp_group, self.dp_size = mesh.group("dp"), mesh.dp
        self.runner: nn.Module = model
        if mesh.pp > 1:
            self.pipeline = self.runner = NativePipeline(model, mesh, plan)
            return
        if mesh.tp > 1:
            shard_linears(model, mesh)
        if plan.zero == 3:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            dp_mesh = torch_mesh(self.dp_group, "dp")
            mp = MixedPrecisionPolicy(
                param_dtype=torch_dtype(
                    plan.param_dtype, allowed=("fp32", "bf16"), what="param_dtype"
                ),
                reduce_dtype=torch.float32,
            )
            for block in model.blocks:
                fully_shard(block, mesh=dp_mesh, mp_policy=mp)
            fully_shard(model, mesh=dp_mesh, mp_policy=mp)
        elif (
            self.dp_size > 1
        ):  # zero 0, or 1/2: gradients all-reduced by torch DDP, states sharded below
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = self.runner = DistributedDataParallel(
                model, process_group=self.dp_group, bucket_cap_mb=plan.bucket_mb
            )

    @property
    def fp16_scaler_ok(self) -> bool:
        return False

    def build_optimizer(self, optimizer_class: type, params=None, **kwargs):
        """The optimizer over this rank's parameters; ZeRO-1/2: ``ZeroRedundancyOptimizer``."""
        if params is None:
            params = [p for p in self.runner.parameters() if p.requires_grad]
        if self.plan.zero in (1, 2):
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(
                params, optimizer_class=optimizer_class, process_group=self.dp_group, **kwargs
            )
        return optimizer_class(params, **kwargs)

    def _grad_items(self) -> list[GradItem]:
        """DTensor gradients with a Shard placement are split (over tp, or dp under FSDP2)."""
        from torch.distributed.tensor import DTensor, Shard

        copy_id = self._stage_copy_id()
        items = []
        for p in self.runner.parameters():
            if not p.requires_grad:
                continue
            g, axis = p.grad, None
            if (
                g is not None
                and isinstance(g, DTensor)
                and any(isinstance(pl, Shard) for pl in g.placements)
            ):
                axis = "tp" if self.mesh.tp > 1 else "dp"
            items.append((g, axis, id(p) != copy_id))
        return items

    def _split_axes(self) -> list[str]:
        if self.plan.zero == 3:
            return ["dp"]
        return ["tp"] if self.mesh.tp > 1 else []

    def _full_state_dict(self) -> dict[str, Tensor]:
        from torch.distributed.tensor import DTensor

        mine = (
            {id(p) for p in self.pipeline.stage.parameters()} if self.pipeline is not None else None
        )
        out = {}
        for n, p in self.model.named_parameters():
            if mine is None or id(p) in mine:
                t = p.full_tensor() if isinstance(p, DTensor) else p
                out[n.replace("_fsdp_wrapped_module.", "")] = t.detach().clone()
        return out


def shard_linears(model: nn.Module, mesh: DeviceMesh) -> None:
    """DTensor tensor parallelism of every block: q/k/v/gate/up colwise, o/down rowwise. The
    attention reads its local head counts from the local projection outputs."""
    cfg = model.config
    check_divisible(mesh.tp, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, d_ff=cfg.d_ff)
    tp_mesh = torch_mesh(mesh.group("tp"), "tp")
    for block in model.blocks:
        for lin in (
            block.attn.q_proj,
            block.attn.k_proj,
            block.attn.v_proj,
            block.ffn.gate_proj,
            block.ffn.up_proj,
        ):
            dtensor_linear(lin, tp_mesh, "colwise")
        for lin in (block.attn.o_proj, block.ffn.down_proj):
            dtensor_linear(lin, tp_mesh, "rowwise")


def dtensor_linear(lin: nn.Module, tp_mesh, style: str) -> None:
    """DTensor tensor parallelism for lmstack's ``Linear`` (torch's ColwiseParallel/RowwiseParallel
    accept only ``nn.Linear``): the same placements through ``distribute_module``.
    colwise: W Shard(0), input Replicate -> output Shard(-1) (local);
    rowwise: W Shard(1), input Shard(-1) -> output Partial -> Replicate (an all-reduce)."""
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
    )

    wp = Shard(0) if style == "colwise" else Shard(1)

    def partition(name, module, mesh):
        for pname, p in list(module.named_parameters(recurse=False)):
            place = wp if pname == "weight" else (Shard(0) if style == "colwise" else Replicate())
            module.register_parameter(
                pname, nn.Parameter(distribute_tensor(p.detach(), mesh, [place]))
            )

    def input_fn(module, inputs, mesh):
        x = inputs[0]
        place = Replicate() if style == "colwise" else Shard(-1)
        return (DTensor.from_local(x, mesh, [place], run_check=False),) + tuple(inputs[1:])

    def output_fn(module, out, mesh):
        if style == "rowwise":
            out = out.redistribute(mesh, [Replicate()])
        return out.to_local()

    distribute_module(lin, tp_mesh, partition, input_fn, output_fn)


class NativePipeline(PipelineParallel):
    """lmstack's pipeline stage (the model's own class holding a slice of its layers) inside
    torch's ``PipelineStage``, run by ``ScheduleGPipe`` / ``Schedule1F1B`` (losses scaled by 1/m
    like lmstack's); the tied-embedding sum, dp average and evaluation pass are lmstack's."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, plan):
        if plan.schedule not in SCHEDULES:
            raise ValueError(
                f"backend='native' pipeline schedule={plan.schedule!r}; expected one of "
                f"{sorted(SCHEDULES)} (lmstack's 'zb' is single-stage-per-rank ZB-H1; torch's "
                "zero-bubble needs virtual stages)"
            )
        super().__init__(
            model,
            mesh.group("pp"),
            plan.micro_batches,
            plan.schedule,
            dp_group=mesh.group("dp") if mesh.dp > 1 else None,
            tied_group=tied_embedding_groups(mesh),
        )
        from torch.distributed.pipelining import PipelineStage as TorchStage

        self.torch_stage = TorchStage(
            self.stage, self.rank_in, self.p, self._device, group=self.group
        )
        self._sched = None
        self._loss_fn = None

    def train_step(self, tokens: Tensor, targets: Tensor, loss_fn) -> float:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        if self._sched is None or self._loss_fn is not loss_fn:
            kind = ScheduleGPipe if self.kind == "gpipe" else Schedule1F1B
            self._sched = kind(self.torch_stage, self.m, loss_fn=loss_fn)
            self._loss_fn = loss_fn
        losses: list = []
        if self.first:
            self._sched.step(tokens)
        elif self.last:
            self._sched.step(target=targets, losses=losses)
        else:
            self._sched.step()
        self.sync_grads()
        loss = torch.tensor(
            [float(sum(float(x) for x in losses) / self.m) if losses else 0.0],
            dtype=torch.float64,
            device=C.comm_device(self.group),
        )
        dist.broadcast(loss, self.ranks[-1], group=self.group)
        return float(loss)
