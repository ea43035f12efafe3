"""Accounting: parameters, FLOPs, memory, arithmetic intensity, roofline and communication.

Pure functions of a ``ModelConfig``, a workload (B, S, T, dtype) and a ``Hardware`` entry;
each formula names its seed section. ``lmstack plan`` prints them (see ``accounting.cli``).
"""

from lmstack.accounting.comm import (
    all_gather_bytes,
    all_reduce_bytes,
    all_reduce_time,
    data_parallel_step_bytes,
    reduce_scatter_bytes,
    tp_compute_comm_ratio,
)
from lmstack.accounting.flops import (
    attention_share,
    backward_flops,
    forward_flops,
    mfu,
    six_nd,
    training_step_flops,
)
from lmstack.accounting.hardware import HARDWARE, Hardware, get_hardware, measure_cpu, ridge_point
from lmstack.accounting.intensity import attention_intensity, ffn_intensity, phase_verdicts
from lmstack.accounting.memory import (
    inference_memory,
    kv_cache_bytes,
    training_memory,
    training_memory_per_device,
)
from lmstack.accounting.params import (
    ParamCounts,
    matmul_params,
    moe_params,
    param_counts,
    total_params,
)
from lmstack.accounting.precision import bytes_per_element
from lmstack.accounting.roofline import decode_point, decode_sweep, plot_roofline, prefill_point

__all__ = [
    "HARDWARE",
    "Hardware",
    "ParamCounts",
    "all_gather_bytes",
    "all_reduce_bytes",
    "all_reduce_time",
    "attention_intensity",
    "attention_share",
    "backward_flops",
    "bytes_per_element",
    "data_parallel_step_bytes",
    "decode_point",
    "decode_sweep",
    "ffn_intensity",
    "forward_flops",
    "get_hardware",
    "inference_memory",
    "kv_cache_bytes",
    "matmul_params",
    "measure_cpu",
    "mfu",
    "moe_params",
    "param_counts",
    "phase_verdicts",
    "plot_roofline",
    "prefill_point",
    "reduce_scatter_bytes",
    "ridge_point",
    "six_nd",
    "total_params",
    "tp_compute_comm_ratio",
    "training_memory",
    "training_memory_per_device",
    "training_step_flops",
]
