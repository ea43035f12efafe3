"""Model integration: attention and RMSNorm backends chosen by config give the same model."""

import subprocess
import sys

import pytest
import torch

from lmstack.kernels.backends import resolve_attn_backend, resolve_norm_backend
from lmstack.model.config import ConfigError, ModelConfig
from lmstack.model.transformer import Transformer

CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64)


def _logits_and_grads(cfg, tokens):
    model = Transformer(cfg, seed=1)
    logits = model(tokens)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attn,norm", [("flash_pytorch", "torch"), ("flash_triton", "torch"), ("sdpa", "triton"),
                                       ("flash_triton", "triton")])
def test_backends_give_the_same_model(attn, norm, request):
    if "triton" in attn + norm:
        request.getfixturevalue("triton_interpreter")
    tokens = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_grads = _logits_and_grads(CFG.replace(attn_backend="reference", norm_backend="torch"), tokens)
    logits, grads = _logits_and_grads(CFG.replace(attn_backend=attn, norm_backend=norm), tokens)
    torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_flash_backend_falls_back_with_masks():
    # sliding window and packed documents need an explicit mask: the flash backends hand them to sdpa
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    docs = torch.tensor([[0] * 7 + [1] * 9])
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    for extra in (dict(sliding_window=5), dict()):
        cfg = CFG.replace(**extra)
        a = Transformer(cfg.replace(attn_backend="flash_pytorch"), seed=2)
        b = Transformer(cfg.replace(attn_backend="sdpa"), seed=2)
        kw = dict(positions=pos, document_ids=docs) if not extra else {}
        torch.testing.assert_close(a(tokens, **kw), b(tokens, **kw))


def test_set_attn_and_norm_backend():
    model = Transformer(CFG, seed=0)
    tokens = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    base = model(tokens)
    model.set_attn_backend("flash_pytorch")
    assert all(b.attn.backend == "flash_pytorch" for b in model.blocks)
    torch.testing.assert_close(model(tokens), base, atol=2e-6, rtol=1e-5)
    model.set_norm_backend("torch")
    assert model.config.norm_backend == "torch"
    with pytest.raises(ValueError, match="flash9"):
        model.set_attn_backend("flash9")
    with pytest.raises(ValueError, match="cudnn"):
        model.set_norm_backend("cudnn")


def test_config_validation_and_defaults():
    assert ModelConfig().attn_backend == "auto" and ModelConfig().norm_backend == "auto"
    with pytest.raises(ConfigError, match="norm_backend='apex'"):
        ModelConfig(norm_backend="apex")
    # "auto" keeps the CPU behaviour: SDPA attention, the eager RMSNorm formula
    assert resolve_attn_backend("auto", "cpu") == "sdpa"
    assert resolve_norm_backend("auto", torch.zeros(2)) == "torch"
    assert resolve_attn_backend("flash_pytorch", "cpu") == "flash_pytorch"


def test_import_does_not_load_triton():
    code = ("import sys, lmstack, lmstack.kernels, lmstack.model.transformer, lmstack.cli;"
            "lmstack.cli.build_parser();"
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_lazy_aliases_stay_callable(triton_interpreter):
    # the package's lazy aliases must not be shadowed by their submodules once those are imported
    import lmstack.kernels as kernels
    import lmstack.kernels.flash_triton  # noqa: F401
    import lmstack.kernels.triton_rmsnorm  # noqa: F401

    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(kernels.rmsnorm_triton(x, torch.ones(16)), kernels.rms_norm(x, torch.ones(16), 1e-5, "torch"))
    torch.testing.assert_close(kernels.flash_attention_triton(x[None], x[None], x[None], causal=True),
                               kernels.flash_attention_pytorch(x[None], x[None], x[None], causal=True), atol=2e-6, rtol=1e-5)
