"""Model integration: attention and RMSNorm backends chosen by the runtime config give the same model."""

import subprocess
import sys

import pytest
import torch

from lmstack.kernels.backends import resolve_attn_backend, resolve_norm_backend
from lmstack.kernels.runtime import RuntimeConfig, configure
from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer

CFG = ModelConfig(
    vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64
)


def _build(cfg, attn="auto", norm="auto", seed=1):
    model = Transformer(cfg, seed=seed)
    configure(model, RuntimeConfig(attn, norm))
    return model


def _logits_and_grads(cfg, tokens, attn, norm):
    model = _build(cfg, attn, norm)
    logits = model(tokens)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "attn,norm",
    [
        ("flash_pytorch", "torch"),
        ("flash_triton", "torch"),
        ("sdpa", "triton"),
        ("flash_triton", "triton"),
    ],
)
def test_backends_give_the_same_model(attn, norm, request):
    if "triton" in attn + norm:
        request.getfixturevalue("triton_interpreter")
    tokens = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_grads = _logits_and_grads(CFG, tokens, "reference", "torch")
    logits, grads = _logits_and_grads(CFG, tokens, attn, norm)
    torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(
            g,
            ref_grads[name],
            atol=2e-5,
            rtol=1e-4,
            msg=lambda m: f"{name}: {m}",  # noqa: B023
        )


def test_flash_backend_falls_back_with_masks():
    # sliding window and packed documents need an explicit mask: the flash backends hand them to sdpa
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    docs = torch.tensor([[0] * 7 + [1] * 9])
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    for extra in (dict(sliding_window=5), dict()):
        cfg = CFG.replace(**extra)
        a = _build(cfg, "flash_pytorch", seed=2)
        b = _build(cfg, "sdpa", seed=2)
        kw = dict(positions=pos, document_ids=docs) if not extra else {}
        torch.testing.assert_close(a(tokens, **kw), b(tokens, **kw))


def test_configure_sets_the_implementations_once():
    model = Transformer(CFG, seed=0)
    assert model.attention.name == "sdpa"  # a model built without a runtime: the seam's default
    tokens = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    base = model(tokens)
    line = configure(model, RuntimeConfig("flash_pytorch", "torch"))
    assert line.startswith(
        "attention: flash_pytorch (configured); rmsnorm: torch (configured); gemm: "
    )
    assert all(b.attn.impl.name == "flash_pytorch" for b in model.blocks)
    torch.testing.assert_close(model(tokens), base, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="flash9"):
        RuntimeConfig(attn_backend="flash9")
    with pytest.raises(ValueError, match="cudnn"):
        RuntimeConfig(norm_backend="cudnn")


def test_auto_is_decided_once_and_logged():
    model = Transformer(CFG, seed=0)
    bf16 = RuntimeConfig(dtype="bf16")
    line = configure(model, bf16, training=True, max_keys=256)
    assert line.startswith(
        "attention: matmul (auto: CPU, bf16 autocast, ≤512 keys); rmsnorm: torch (auto); gemm: "
    )
    assert model.attention.name == "matmul"
    assert configure(model, bf16, training=True, max_keys=1024).startswith(
        "attention: sdpa (auto: CPU, >512 keys)"
    )
    assert configure(model).startswith("attention: sdpa (auto: CPU)")
    assert configure(model, bf16, max_keys=256).startswith(
        "attention: sdpa (auto: CPU)"
    )  # inference: no autocast
    assert configure(model, RuntimeConfig(dtype="bf16", compile=True), training=True).startswith(
        "attention: sdpa (auto: CPU, compiled)"
    )


def test_runtime_keys_left_the_model_config():
    # an lmstack config.json written before RuntimeConfig still loads; the backends are not architecture
    cfg = ModelConfig.from_dict({**CFG.to_dict(), "attn_backend": "sdpa", "norm_backend": "torch"})
    assert cfg == CFG and "attn_backend" not in cfg.to_dict()
    with pytest.raises(TypeError):
        ModelConfig(attn_backend="sdpa")


def test_config_validation_and_defaults():
    assert RuntimeConfig() == RuntimeConfig("auto", "auto")
    with pytest.raises(ValueError, match="norm_backend='apex'"):
        RuntimeConfig(norm_backend="apex")
    # "auto" keeps the CPU behaviour: SDPA attention, the eager RMSNorm formula
    assert resolve_attn_backend("auto", "cpu") == "sdpa"
    assert resolve_norm_backend("auto", torch.zeros(2)) == "torch"
    assert resolve_attn_backend("flash_pytorch", "cpu") == "flash_pytorch"


def test_import_does_not_load_triton():
    code = (
        "import sys, lmstack, lmstack.kernels, lmstack.model.transformer, lmstack.cli;"
        "lmstack.cli.build_parser();"
        "print('triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_lazy_aliases_stay_callable(triton_interpreter):
    # the package's lazy aliases must not be shadowed by their submodules once those are imported
    import lmstack.kernels as kernels
    import lmstack.kernels.flash_triton  # noqa: F401
    import lmstack.kernels.triton_rmsnorm  # noqa: F401
    from lmstack.model.layers import rms_norm

    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(
        kernels.rmsnorm_triton(x, torch.ones(16)), rms_norm(x, torch.ones(16), 1e-5)
    )
    torch.testing.assert_close(
        kernels.flash_attention_triton(x[None], x[None], x[None], causal=True),
        kernels.flash_attention_pytorch(x[None], x[None], x[None], causal=True),
        atol=2e-6,
        rtol=1e-5,
    )
