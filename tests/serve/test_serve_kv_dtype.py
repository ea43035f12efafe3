"""``lmstack serve --kv-cache-dtype``: a bad name refused with the choices, "auto" resolved from the model's
compute dtype (fp16 K/V for an fp32 model on the CPU, as llama.cpp's default), the default pool sized by the
chosen dtype (hand counts), and the names passed through ``LLM`` / ``LLMEngine``."""

import types

import pytest
import torch
from serve_helpers import tiny_model, tiny_tokenizer

from lmstack.cli import main
from lmstack.inference import LLM, LLMEngine
from lmstack.serve.cli import default_kv_cache_bytes, resolve_kv_cache_dtype


def _fake(dtype):
    """A model whose only parameter is ``dtype`` (what the resolution reads)."""
    return types.SimpleNamespace(parameters=lambda: iter([torch.empty(0, dtype=dtype)]))


def test_a_bad_kv_cache_dtype_names_the_value_and_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "unused", "--kv-cache-dtype", "f16"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "'f16'" in err
    assert all(name in err for name in ("auto", "fp32", "bf16", "fp16", "int8", "fp8"))


def test_auto_is_fp16_for_an_fp32_model_else_the_models_dtype():
    dtype, why = resolve_kv_cache_dtype("auto", _fake(torch.float32))
    assert dtype == torch.float16 and "fp32" in why and "llama.cpp" in why
    assert resolve_kv_cache_dtype("auto", _fake(torch.int8))[0] == torch.float16  # int4/int8 codes
    assert resolve_kv_cache_dtype("auto", _fake(torch.bfloat16))[0] == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", _fake(torch.float64))[0] == torch.float64
    assert resolve_kv_cache_dtype("fp32", _fake(torch.float32)) == (
        torch.float32,
        "--kv-cache-dtype fp32",
    )
    assert resolve_kv_cache_dtype("int8", _fake(torch.float32))[0] == "int8"


def test_the_default_pool_is_sized_by_the_chosen_dtype():
    """Hand count (the tiny model: 2 layers, 2 KV heads of 16, 64 seats x 16 blocks + the null block of 16
    tokens): 2·2·2·16 = 128 elements per token, 2 bytes each in fp16; int8: 1 byte plus 2·NB·L·K scales of 4."""
    model, blocks = tiny_model(), 64 * 16 + 1
    assert default_kv_cache_bytes(model, 64, None, torch.float16) == blocks * 16 * 128 * 2
    assert (
        default_kv_cache_bytes(model, 64, None, "int8")
        == blocks * 16 * 128 + 2 * blocks * 2 * 2 * 4
    )
    assert default_kv_cache_bytes(model, 64, None) == blocks * 16 * 128 * 8  # the model's float64


@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_llm_and_llm_engine_take_the_flag_names(name, dtype):
    engine = LLMEngine(tiny_model(), kv_dtype=name, num_blocks=8, compile=False)
    assert engine.cache.k.dtype == dtype
    llm = LLM(tiny_model(), tiny_tokenizer(), kv_dtype=name, num_blocks=8, compile=False)
    assert llm.engine.cache.k.dtype == dtype
    with pytest.raises(ValueError, match="kv_dtype='f16'"):
        LLMEngine(tiny_model(), kv_dtype="f16", num_blocks=8, compile=False)
