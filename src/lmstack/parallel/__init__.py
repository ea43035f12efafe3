"""Distributed training on torch.distributed (Book of LLMs §6 “parallelism”, CS336 notes "分布式训练").

collectives  ring all-reduce = reduce-scatter + all-gather, byte counting, autograd duals
mesh         DeviceMesh with named axes (pp, dp, cp, tp; ep inside dp)
ddp          naive and bucketed-overlapped data parallelism, no_sync
zero         ZeRO-1/2 (ZeroOptimizer) and ZeRO-3 / FSDP (FullyShard)
tensor       Megatron tensor parallelism, sequence parallelism, vocab-parallel embedding and loss
pipeline     stages, GPipe / 1F1B / zero-bubble schedules, bubble simulation and measurement
context      ring attention (causal, load-balanced) for context parallelism
expert       all-to-all dispatch/combine: the expert-parallel seam for MoE layers
interface    ParallelWrapper: the one interface the trainer calls; WrapperBase, what both implement alike
plan         ParallelPlan, ParallelModel, parallelize(model, plan), the trainer seam get_parallelize
native       NativeParallelModel: the same plans on torch DDP, FSDP2, DTensor, ZeroRedundancyOptimizer, pipelining
"""

from lmstack.parallel.collectives import (
    CommCounter,
    all_gather,
    all_reduce,
    count_bytes,
    reduce_scatter,
    ring_all_reduce_,
)
from lmstack.parallel.context import ContextParallel, ring_attention
from lmstack.parallel.ddp import DataParallel, broadcast_module
from lmstack.parallel.interface import ParallelWrapper
from lmstack.parallel.mesh import DeviceMesh
from lmstack.parallel.native import NativeParallelModel
from lmstack.parallel.pipeline import PipelineParallel, bubble_formula, schedule, simulate
from lmstack.parallel.plan import (
    ParallelModel,
    ParallelPlan,
    get_parallelize,
    init_distributed,
    parallelize,
)
from lmstack.parallel.tensor import TensorParallel, vocab_parallel_cross_entropy
from lmstack.parallel.zero import FullyShard, ZeroOptimizer

__all__ = [
    "CommCounter",
    "all_gather",
    "all_reduce",
    "count_bytes",
    "reduce_scatter",
    "ring_all_reduce_",
    "ContextParallel",
    "ring_attention",
    "DataParallel",
    "broadcast_module",
    "DeviceMesh",
    "PipelineParallel",
    "bubble_formula",
    "schedule",
    "simulate",
    "ParallelWrapper",
    "NativeParallelModel",
    "ParallelModel",
    "ParallelPlan",
    "get_parallelize",
    "init_distributed",
    "parallelize",
    "TensorParallel",
    "vocab_parallel_cross_entropy",
    "FullyShard",
    "ZeroOptimizer",
]
