"""``backend="native"``: the same plans on PyTorch's production implementations.

- DDP        -> ``torch.nn.parallel.DistributedDataParallel`` (bucketed, overlapped; C++ reducer)
- ZeRO-3     -> FSDP2 ``torch.distributed.fsdp.fully_shard`` per block, then the root
               (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` for bf16)
- TP         -> DTensor ``parallelize_module``: q/k/v/gate/up ``ColwiseParallel``, o/down
               ``RowwiseParallel`` (embedding and unembedding stay replicated)
- ZeRO-1/2   -> ``torch.distributed.optim.ZeroRedundancyOptimizer`` (states sharded)
- PP         -> ``torch.distributed.pipelining``: lmstack's stage module in torch's ``PipelineStage``,
               ``ScheduleGPipe`` / ``Schedule1F1B``

The tests train the same plan with both backends and compare losses and parameters, so the
hand-written strategies are checked against torch's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lmstack.parallel.mesh import DeviceMesh


def _torch_mesh(group, name: str):
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    return TorchMesh.from_group(group, "cpu" if not torch.cuda.is_available() else "cuda", mesh_dim_names=(name,))


def native_parallelize(model: nn.Module, plan, mesh: DeviceMesh):
    from lmstack.parallel.plan import ParallelModel

    if mesh.cp > 1:
        raise ValueError("backend='native' covers dp, zero, tp and pp; use backend='lmstack' for cp")
    pm = ParallelModel(model, plan, mesh)
    pm.native = True
    runner: nn.Module = model
    if mesh.pp > 1:
        if mesh.tp > 1 or plan.zero != 0:
            raise ValueError("backend='native' pp composes only with plain dp here; use backend='lmstack'")
        from lmstack.parallel.pipeline import tied_embedding_groups

        pm.pipeline = NativePipeline(model, mesh, plan, tied_embedding_groups(mesh))
        pm.runner = pm.pipeline
        return pm
    if mesh.tp > 1:
        tp_mesh = _torch_mesh(mesh.group("tp"), "tp")
        cfg = model.config
        for name in ("n_heads", "n_kv_heads", "d_ff"):
            if getattr(cfg, name) % mesh.tp:
                raise ValueError(f"tensor parallelism: {name}={getattr(cfg, name)} is not divisible by tp={mesh.tp}")
        for block in model.blocks:
            for lin in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj, block.ffn.gate_proj, block.ffn.up_proj):
                _dtensor_linear(lin, tp_mesh, "colwise")
            for lin in (block.attn.o_proj, block.ffn.down_proj):
                _dtensor_linear(lin, tp_mesh, "rowwise")
            block.attn.n_heads //= mesh.tp
            block.attn.n_kv_heads //= mesh.tp
    if plan.zero == 3:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dp_mesh = _torch_mesh(pm.dp_group, "dp")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if plan.param_dtype == "bf16" else torch.float32,
                                  reduce_dtype=torch.float32)
        if mesh.tp > 1:
            raise ValueError("backend='native' zero=3 with tp>1 needs a 2-D torch mesh; use backend='lmstack'")
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
        runner = model
    elif pm.dp_size > 1 and plan.zero == 0:
        from torch.nn.parallel import DistributedDataParallel

        runner = DistributedDataParallel(model, process_group=pm.dp_group, bucket_cap_mb=plan.bucket_mb)
        pm.ddp = runner
    elif plan.zero in (1, 2):
        # gradient all-reduce by torch DDP; the optimizer states are sharded by ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        runner = DistributedDataParallel(model, process_group=pm.dp_group, bucket_cap_mb=plan.bucket_mb)
        pm.ddp = runner
    pm.runner = runner
    if plan.zero in (1, 2):
        def build_optimizer(optimizer_class, params=None, **kwargs):
            from torch.distributed.optim import ZeroRedundancyOptimizer

            if params is None:
                params = [p for p in model.parameters() if p.requires_grad]
            return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=pm.dp_group,
                                           **kwargs)
        pm.build_optimizer = build_optimizer
    return pm


def _dtensor_linear(lin: nn.Module, tp_mesh, style: str) -> None:
    """DTensor tensor parallelism for lmstack's ``Linear`` (torch's ColwiseParallel/RowwiseParallel
    accept only ``nn.Linear``): the same placements through ``distribute_module``.
    colwise: W Shard(0), input Replicate -> output Shard(-1) (local);
    rowwise: W Shard(1), input Shard(-1) -> output Partial -> Replicate (an all-reduce)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

    wp = Shard(0) if style == "colwise" else Shard(1)

    def partition(name, module, mesh):
        for pname, p in list(module.named_parameters(recurse=False)):
            place = wp if pname == "weight" else (Shard(0) if style == "colwise" else Replicate())
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), mesh, [place])))

    def input_fn(module, inputs, mesh):
        x = inputs[0]
        place = Replicate() if style == "colwise" else Shard(-1)
        return (DTensor.from_local(x, mesh, [place], run_check=False),) + tuple(inputs[1:])

    def output_fn(module, out, mesh):
        if style == "rowwise":
            out = out.redistribute(mesh, [Replicate()])
        return out.to_local()

    distribute_module(lin, tp_mesh, partition, input_fn, output_fn)


class NativePipeline(nn.Module):
    """``torch.distributed.pipelining``: lmstack's stage module inside torch's ``PipelineStage``,
    run by ``ScheduleGPipe`` / ``Schedule1F1B`` (gradients scaled by 1/m like lmstack's)."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, plan, tied_group):
        super().__init__()
        from torch.distributed.pipelining import PipelineStage as TorchStage, Schedule1F1B, ScheduleGPipe

        from lmstack.parallel.pipeline import PipelineParallel, PipelineStage

        kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
        if plan.schedule not in kinds:
            raise ValueError(f"backend='native' pipeline schedule={plan.schedule!r}; expected one of {sorted(kinds)} "
                             "(lmstack's 'zb' is single-stage-per-rank ZB-H1; torch's zero-bubble needs virtual stages)")
        self.p, self.s = mesh.pp, mesh.rank("pp")
        self.group, self.ranks = mesh.group("pp"), mesh.ranks("pp")
        self.stage = PipelineStage(model, self.s, self.p)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.torch_stage = TorchStage(self.stage, self.s, self.p, device, group=self.group)
        self.kind, self.m = kinds[plan.schedule], plan.micro_batches
        self.dp_group = mesh.group("dp") if mesh.dp > 1 else None
        self.tied_group = tied_group
        self._sched = None
        self._loss_fn = None
        # reuse lmstack's tied-embedding and dp gradient averaging
        self._helper = PipelineParallel.__new__(PipelineParallel)
        nn.Module.__init__(self._helper)
        self._helper.stage, self._helper.p, self._helper.tied_group = self.stage, self.p, tied_group
        self._helper.dp_group = self.dp_group

    def forward(self, tokens: Tensor, positions: Tensor | None = None, document_ids: Tensor | None = None) -> Tensor:
        """Without gradients only (evaluation): lmstack's forward-only pass over the same stages."""
        from lmstack.parallel.pipeline import forward_only

        if torch.is_grad_enabled():
            raise RuntimeError("NativePipeline trains through train_step; forward alone only under torch.no_grad()")
        return forward_only(self.stage, self.group, self.ranks, self.s, self.p, tokens, positions, document_ids)

    def train_step(self, tokens: Tensor, targets: Tensor, loss_fn) -> float:
        import torch.distributed as dist

        if self._sched is None or self._loss_fn is not loss_fn:
            self._sched = self.kind(self.torch_stage, self.m, loss_fn=loss_fn)
            self._loss_fn = loss_fn
        losses: list = []
        if self.stage.first:
            self._sched.step(tokens)
        elif self.stage.last:
            self._sched.step(target=targets, losses=losses)
        else:
            self._sched.step()
        self._helper.sync_tied()
        if self.dp_group is not None:
            self._helper._dp_average()
        from lmstack.parallel.collectives import comm_device

        loss = torch.tensor([float(sum(float(x) for x in losses) / self.m) if losses else 0.0], dtype=torch.float64,
                            device=comm_device(self.group))
        dist.broadcast(loss, self.ranks[-1], group=self.group)
        return float(loss)


def native_full_state_dict(pm) -> dict[str, Tensor]:
    out = {}
    mine = {id(p) for p in pm.pipeline.stage.parameters()} if pm.pipeline is not None else None
    for n, p in pm.model.named_parameters():
        if mine is not None and id(p) not in mine:
            continue
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n.replace("_fsdp_wrapped_module.", "")] = t.detach().clone()
    return out
