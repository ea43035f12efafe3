"""Distributed training on torch.distributed (seed 000 §6, seed 001 "分布式训练").

collectives  ring all-reduce = reduce-scatter + all-gather, byte counting, autograd duals
mesh         DeviceMesh with named axes (pp, dp, cp, tp; ep inside dp)
ddp          naive and bucketed-overlapped data parallelism, no_sync
zero         ZeRO-1/2 (ZeroOptimizer) and ZeRO-3 / FSDP (FullyShard)
"""

from lmstack.parallel.collectives import (
    CommCounter,
    all_gather,
    all_reduce,
    count_bytes,
    reduce_scatter,
    ring_all_reduce_,
)
from lmstack.parallel.ddp import DataParallel, broadcast_module
from lmstack.parallel.mesh import DeviceMesh
from lmstack.parallel.zero import FullyShard, ZeroOptimizer
