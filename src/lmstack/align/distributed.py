"""Data parallelism for the alignment trainers under torchrun: every rank holds the whole model, takes its
share of each step's examples (SFT rows, DPO pairs, GRPO prompts with all their samples), and the learner's
gradients are averaged by ``lmstack.parallel``'s DDP; what a step logs is computed over all ranks.

Book: 数据并行 (split the batch over M replicas, all-reduce the gradients, every replica applies the same
update). A global batch is cut into M equal contiguous slices, so M ranks of B see exactly the rows one
process of M·B sees, and a mean over ranks of equal-sized slices is the global mean.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from lmstack.parallel import collectives as C
from lmstack.parallel.plan import ParallelPlan, init_distributed


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def start(timeout_s: float = 600.0) -> tuple[int, int]:
    """(rank, world size): torch.distributed initialised from torchrun's environment when WORLD_SIZE > 1
    (gloo on CPU), (0, 1) for one process."""
    if env_world_size() > 1:
        init_distributed(timeout_s=timeout_s)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def data_parallel_plan(spec, world: int):
    """The plan an alignment trainer runs: ``spec`` (default "ddp" under torchrun), which must be data
    parallel only — tensor, pipeline, context and expert parallelism are refused by name."""
    if world == 1 and not spec:
        return None
    plan = ParallelPlan.parse(spec or "ddp")
    other = {k: getattr(plan, k) for k in ("tp", "pp", "cp", "ep") if getattr(plan, k) != 1}
    if other or plan.zero == 3 or plan.backend != "lmstack":
        raise ValueError(
            f"parallel={spec!r}: the alignment trainers run data parallel only (ddp, zero1, zero2), "
            f"not {other or {'zero': plan.zero, 'backend': plan.backend}}"
        )
    return spec or "ddp"


def rank_slice(n: int, rank: int, world: int, what: str) -> slice:
    """This rank's contiguous 1/world of ``n`` items (``n`` must divide evenly)."""
    if n % world:
        raise ValueError(f"{what}={n} must be divisible by the number of ranks ({world})")
    k = n // world
    return slice(rank * k, (rank + 1) * k)


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over ranks (float64 on the CPU); the tensor itself for one process."""
    t = values.detach().to(torch.float64).cpu().clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        C.all_reduce(t)
    return t


def all_max(value: float) -> float:
    """The largest ``value`` over ranks (wall times: a step takes as long as its slowest rank)."""
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (the same shape on all) stacked along dim 0 in rank order."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    flat = C.all_gather(t.detach().cpu().contiguous().reshape(-1))
    return flat.reshape(dist.get_world_size() * t.shape[0], *t.shape[1:])


def gather_objects(obj) -> list:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` for one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
