"""Weight-only quantisation: int8 per-output-channel and int4 grouped linear layers (CS336 notes "量化").

``quantize_model(model, "int8")`` swaps every ``Linear`` of an lmstack ``Transformer`` for a
quantised one in place; activations stay in floating point (weight-only), so the bytes a
decode step reads shrink 4x (int8) or ~7x (int4) against fp32 weights.

Post-training methods with calibration data: GPTQ (``gptq``), AWQ (``awq``); LLM.int8() with
outlier columns in 16-bit (``llm_int8``). Formats: fp8 / MXFP8 / MXFP4 / NF4 in simulation (``formats``);
GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K blocks read directly (``gguf_blocks``). The int8 / fp8 KV
codec (``kv_codec``, used by ``inference.kv_cache`` and ``inference.paged``), fake-quant training with a straight-through estimator (``qat``), dynamic loss
scaling for fp16 (``loss_scale``), width pruning + distillation (``prune``, ``lmstack compress``).
"""

from lmstack.quant.gptq import CalibrationError, gptq_quantize, gptq_quantize_model
from lmstack.quant.int4 import Int4Linear, dequantize_int4, quantize_int4
from lmstack.quant.int8 import Int8Linear, dequantize_int8, quantize_int8
from lmstack.quant.linear import WeightOnlyLinear
from lmstack.quant.model import (
    FORMATS,
    QUANT_METHODS,
    WeightFormat,
    quantize_model,
    quantized_weight_bytes,
    register_format,
)

__all__ = [
    "CalibrationError",
    "gptq_quantize",
    "gptq_quantize_model",
    "Int4Linear",
    "Int8Linear",
    "FORMATS",
    "QUANT_METHODS",
    "WeightFormat",
    "register_format",
    "dequantize_int4",
    "dequantize_int8",
    "quantize_int4",
    "quantize_int8",
    "quantize_model",
    "quantized_weight_bytes",
    "WeightOnlyLinear",
]
