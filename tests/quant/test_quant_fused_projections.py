"""Fused quantised projections (``WeightOnlyLinear.concat_rows``, used by ``Transformer.fuse_projections``):
q/k/v and gate/up as one ``Int4Linear`` / ``Int8Linear``, one activation quantisation and one kernel call.

Quantisation groups run along the inputs, so the fused layer's codes and scales are the parts' stacked by
output rows: each output row is computed from the same codes, the same quantised activations and in the
same order as before, so the fused output equals the separate outputs bit for bit (torch's own int8 kernel
may block its work by the output width: there to float rounding). The kernels are also checked against
their formula in numpy float64 (``reference``), and a quantised model and the engine give the same greedy
tokens fused and unfused."""

import copy

import numpy as np
import pytest
import torch

from lmstack.inference import LLMEngine, SamplingParams
from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.quant import Int4Linear, Int8Linear, int4_vnni, quantize_int4, quantize_model
from lmstack.quant.int8 import quantize_int8

pytestmark = pytest.mark.usefixtures("one_thread")
WIDTHS = (
    64,
    32,
    32,
)  # q, k, v output widths (N·H, K·H, K·H), multiples of the kernels' 16-row tiles


def reference_int4(x, q, s, lo, G, terms):
    """y = Σ_g d·Σ_t s_t·Σ_{i∈g} q·x_t + m·Σ_{i∈g} x in float64, with the kernels' fp16 d, m and per-group
    int8 activation terms (s_1 = max|x_g|/127 in float32, x_1 = round(x / s_1), the second the residual's)."""
    d, m = s.half().double().numpy(), lo.half().double().numpy()  # (O, NG)
    x = x.double().numpy()
    M, I = x.shape
    xg = x.reshape(M, I // G, G)
    qg = q.double().numpy().reshape(q.shape[0], I // G, G)
    dot, rest = 0.0, xg
    for _ in range(terms):
        st = (np.abs(rest).max(-1) / 127).astype(np.float32).astype(np.float64)
        xq = np.clip(np.round(rest / np.where(st > 0, st, 1)[..., None]), -127, 127)
        dot = dot + np.einsum("ogi,mgi->mog", qg, xq) * st[:, None]
        rest = rest - xq * st[..., None]
    return (dot * d[None] + m[None] * xg.sum(-1)[:, None]).sum(-1)  # (M, O)


def _int4_parts(kernel, terms, I=128, G=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    quants = [quantize_int4(torch.randn(o, I, generator=g), G) for o in WIDTHS]
    parts = []
    for q, s, lo in quants:
        lin = Int4Linear(q, s, lo, kernel=kernel)
        lin.terms = terms
        parts.append(lin)
    return quants, parts


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("kernel", int4_vnni.KERNELS)
def test_fused_int4_equals_the_parts_bit_for_bit_and_the_float64_formula(kernel, terms):
    if int4_vnni.build(kernel) is not None:
        pytest.skip(f"kernel {kernel} cannot run here: {int4_vnni.build(kernel)}")
    quants, parts = _int4_parts(kernel, terms)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        separate = torch.cat([p(x) for p in parts], dim=-1)
        fused = Int4Linear.concat_rows(parts)
        assert fused is not None and fused.out_features == sum(WIDTHS)
        assert (fused.kernel, fused.terms, fused.group_size) == (kernel, terms, 32)
        y = fused(x)
    assert torch.equal(y, separate)  # same codes, same activation quantisation, same order per row
    ref = np.concatenate([reference_int4(x, q, s, lo, 32, terms) for q, s, lo in quants], axis=-1)
    np.testing.assert_allclose(y.double().numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # the parts now read row views of the fused codes (no second copy), and still compute the same
    assert parts[1].qweight.data_ptr() == fused.qweight[WIDTHS[0] // 16].data_ptr()
    with torch.inference_mode():
        assert torch.equal(torch.cat([p(x) for p in parts], dim=-1), separate)


def test_fused_int8_equals_the_parts():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 128, generator=g)
    for kernel in ("aten", "avx2"):
        if kernel == "avx2" and int4_vnni.build("int8_avx2") is not None:
            continue
        ws = [torch.randn(o, 128, generator=g) for o in WIDTHS]
        parts = [Int8Linear(*quantize_int8(w), kernel=kernel) for w in ws]
        with torch.inference_mode():
            separate = torch.cat([p(x) for p in parts], dim=-1)
            fused = Int8Linear.concat_rows(parts)
            assert fused is not None and fused.kernel == kernel
            y = fused(x)
        if kernel == "avx2":  # lmstack's kernel: per row, the same work in the same order
            assert torch.equal(y, separate)
        else:  # torch's: bf16 activations, its own blocking over the outputs
            torch.testing.assert_close(y, separate, rtol=2e-2, atol=2e-2)
        # against F.linear on the dequantised weights (int8 rows, bf16 / two-term int8 activations)
        full = x.double() @ torch.cat([p.dequantized_weight().double() for p in parts]).T
        assert float((y.double() - full).norm() / full.norm()) < 1e-2


def test_concat_rows_refuses_what_it_cannot_join():
    _, parts = _int4_parts(int4_vnni.kernel() if int4_vnni.available() else "aten", 2)
    parts[2].terms = 1  # another number of activation terms: not one call
    assert Int4Linear.concat_rows(parts) is None
    q, s = quantize_int8(torch.randn(32, 128))
    assert Int4Linear.concat_rows([parts[0], Int8Linear(q, s)]) is None  # two classes
    q4, s4, lo4 = quantize_int4(torch.randn(32, 128), 32)
    aten = [Int4Linear(q4, s4, lo4, kernel="aten") for _ in range(2)]
    if aten[
        0
    ].use_kernel:  # torch's packing keeps (scale, zero) as (I/G, O, 2): not stacked by rows
        assert Int4Linear.concat_rows(aten) is None


def _quantised_model(method):
    cfg = ModelConfig(
        vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=128
    )
    return quantize_model(Transformer(cfg, seed=0).eval(), method, lm_head=False)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_fused_quantised_model_and_engine_greedy_equal_unfused(method, monkeypatch):
    # each layer measures from how many rows its dequantised GEMM beats its kernel, per weight shape: on a
    # loaded machine the fused shape and its parts can come out on different sides at these few rows, and the
    # two paths round differently. Pinned to the kernel, so what is checked is that fusing itself is exact.
    monkeypatch.setenv("LMSTACK_QUANT_GEMM_ROWS", "never")
    model = _quantised_model(method)
    plain = copy.deepcopy(model)
    keys = list(model.state_dict())
    assert model.fuse_projections() == 2 * model.config.n_layers  # every attention and SwiGLU
    assert (
        list(model.state_dict()) == keys
    )  # checkpoints unchanged: the fused modules are no submodules
    attn = model.blocks[0].attn
    assert attn.qkv is not None and isinstance(attn.qkv[0], (Int4Linear, Int8Linear))
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens), plain(tokens), rtol=0, atol=0)
        assert (
            attn.qkv is not None and model.blocks[1].ffn.gate_up is not None
        )  # the fused path ran
        # a replaced part (re-quantised, LoRA-wrapped, ...): the layer goes back to its separate linears
        ffn = model.blocks[1].ffn
        ffn.up_proj = copy.deepcopy(ffn.up_proj)
        ffn.up_proj.qweight = ffn.up_proj.qweight.clone()
        torch.testing.assert_close(model(tokens), plain(tokens), rtol=0, atol=0)
        assert ffn.gate_up is None
    prompts = [[5, 17, 3, 88, 41], [9, 9, 60, 2, 31, 70, 14]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for fuse in (True, False):
        engine = LLMEngine(copy.deepcopy(plain), max_num_seqs=2, fuse_projections=fuse)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
        outs.append(done)
        fused_layers = [b.attn.qkv is not None for b in engine.model.blocks]
        assert all(fused_layers) == fuse
    assert outs[0] == outs[1]
