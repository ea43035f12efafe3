"""Bytes per element of each precision (Book of LLMs §5.2 "精度选项全景对比", CS336 notes "内存占用").

fp32 4 bytes, fp16/bf16 2 bytes, int8 (and fp8) 1 byte, int4 half a byte. tf32 is a tensor-core
compute mode over fp32 storage, so it occupies 4 bytes.
"""

from __future__ import annotations

_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
    "tf32": "tf32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp8": "fp8",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "e4m3": "fp8",
    "e5m2": "fp8",
    "int8": "int8",
    "uint8": "int8",
    "i8": "int8",
    "int4": "int4",
    "i4": "int4",
}

# Book of LLMs §5.2 “precision formats”: FP32 4 B, FP16 2 B, BF16 2 B, INT8 1 B, INT4 0.5 B.
BYTES_PER_ELEMENT: dict[str, float] = {
    "fp32": 4,
    "tf32": 4,
    "fp16": 2,
    "bf16": 2,
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
}


def canonical_dtype(dtype: object) -> str:
    """Map "bfloat16", torch.bfloat16, "BF16", ... to one of the keys of BYTES_PER_ELEMENT."""
    name = str(dtype).lower().removeprefix("torch.")
    if name not in _ALIASES:
        raise ValueError(
            f"dtype={dtype!r} is not known; expected one of {sorted(BYTES_PER_ELEMENT)}"
        )
    return _ALIASES[name]


def bytes_per_element(dtype: object) -> float:
    """P in CS336 notes's Memory_KV = 2·P·B·S·L·K·H: bytes one element of ``dtype`` takes (§5.2)."""
    return BYTES_PER_ELEMENT[canonical_dtype(dtype)]
