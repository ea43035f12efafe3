"""The static-cache batch-1 path (eager and torch.compile'd decode step): greedy output equals the
full recompute token for token; one decoder serves several prompts."""

import pytest
import torch
from inference_helpers import full_recompute_greedy, greedy

from lmstack.accounting.memory import kv_cache_bytes
from lmstack.inference import SamplingParams, generate
from lmstack.inference.kv_cache import StaticKVCache
from lmstack.inference.static import StaticDecoder

N = 10


def test_static_cache_bytes_and_positions(model):
    cache = StaticKVCache(model.config, 1, 48, dtype=torch.float32)
    assert cache.nbytes == kv_cache_bytes(model.config, 1, 48, "fp32")
    k = torch.randn(1, model.config.n_kv_heads, 3, model.config.head_dim)
    k_all, v_all, pos = cache.update(0, k, -k, torch.tensor([0, 1, 2]))
    assert k_all.shape == (1, model.config.n_kv_heads, 48, model.config.head_dim)
    assert pos[0, :4].tolist() == [0, 1, 2, -1] and (pos[0, 3:] == -1).all()
    assert torch.equal(k_all[:, :, :3], k) and torch.equal(v_all[:, :, :3], -k)
    cache.live = 3  # an eager forward that knows slots 0..2 are all there is: views of those only
    k_live, v_live, pos_live = cache.update(0, k, -k, torch.tensor([0, 1, 2]))
    assert k_live.shape[2] == 3 and pos_live.tolist() == [[0, 1, 2]]
    assert torch.equal(k_live, k) and torch.equal(v_live, -k)
    cache.live = None
    cache.reset()  # the decoder's next prompt starts on an empty cache
    assert (pos == -1).all()
    with pytest.raises(ValueError, match="positions of shape"):
        cache.update(0, k, k, torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="max_seq_len"):
        StaticKVCache(model.config, 1, 10_000)
    with pytest.raises(ValueError, match="compile_mode='fastest'"):
        StaticDecoder(model, 64, compile=True, compile_mode="fastest")


def test_static_decoder_greedy_equals_full_recompute(model, prompts):
    decoder = StaticDecoder(model, 64)  # reused (reset) across all prompts
    for p in prompts:
        assert list(generate(model, p, greedy(N), decoder=decoder)) == full_recompute_greedy(
            model, p, N
        )


def test_static_decoder_sampling_matches_dynamic_cache(model, prompts):
    decoder = StaticDecoder(model, 64)
    params = SamplingParams(
        max_tokens=N, temperature=0.9, top_p=0.9, seed=7, repetition_penalty=1.3
    )
    for p in prompts[:4]:
        assert list(generate(model, p, params, decoder=decoder)) == list(generate(model, p, params))
    with pytest.raises(ValueError, match="max_seq_len=64"):
        list(generate(model, prompts[-1], greedy(60), decoder=decoder))


@pytest.mark.slow
def test_compiled_decoder_greedy_equals_full_recompute(model, prompts):
    torch._dynamo.reset()
    decoder = StaticDecoder(model, 64, compile=True)
    for p in prompts[:6] + prompts[-3:]:
        assert list(generate(model, p, greedy(N), decoder=decoder)) == full_recompute_greedy(
            model, p, N
        )
    # one graph (the RoPE tables and the warm-up's inference tensors cause no recompile), called directly
    assert len(decoder._graphs) == 1 and decoder._direct is not None
    guarded = StaticDecoder(
        model, 64, compile=True, direct=False
    )  # Dynamo's guarded call on every step
    p = prompts[0]
    assert list(generate(model, p, greedy(N), decoder=guarded)) == full_recompute_greedy(
        model, p, N
    )
    assert guarded._direct is None
    # a step unlike the traced one (int32 ids) goes through Dynamo (a recompile), not the captured graph
    logits = decoder.decode(torch.tensor([[5]]), torch.tensor([0]))
    torch.testing.assert_close(
        decoder.decode(torch.tensor([[5]], dtype=torch.int32), torch.tensor([0])), logits
    )
    assert len(decoder._graphs) == 2
    # Dynamo keeps its backends for the life of the process; they must not keep a decoder (and its model) alive
    import gc
    import weakref

    ref = weakref.ref(decoder)
    del decoder
    gc.collect()
    assert ref() is None


@pytest.mark.slow
def test_compiled_decoder_in_fp32_equals_full_recompute(model, prompts):
    """fp32, the CLI's default (`generate --compile` crashed there: Dynamo met torch.backends.mkldnn.is_available
    inside the oneDNN dispatch check); the float64 fixture never reaches the oneDNN path."""
    import copy

    torch._dynamo.reset()
    m32 = copy.deepcopy(model).float()
    decoder = StaticDecoder(m32, 64, compile=True)
    for p in prompts[:2]:
        assert list(generate(m32, p, greedy(N), decoder=decoder)) == full_recompute_greedy(
            m32, p, N
        )


@pytest.mark.slow
def test_compiled_decoder_runs_an_int8_head_after_the_graph(model, prompts, monkeypatch):
    """An Int8Linear unembedding whose one-row path is oneDNN's int8 GEMM (which inductor cannot take) runs
    eagerly after the compiled graph: greedy output equals the full recompute (oneDNN at every row count
    there too), one graph, called directly."""
    import copy

    from lmstack.quant import Int8Linear
    from lmstack.quant.int8 import has_onednn

    if not has_onednn():
        pytest.skip(
            "the CPU lacks VNNI / AMX: oneDNN's int8 GEMM is not taken here (its int8 sums saturate)"
        )
    monkeypatch.setenv("LMSTACK_QUANT_GEMM_ROWS", "1")
    torch._dynamo.reset()
    m32 = copy.deepcopy(model).float()
    m32.lm_head = Int8Linear.from_weight(m32.unembedding)
    decoder = StaticDecoder(m32, 64, compile=True)
    assert decoder._eager_head
    for p in prompts[:3]:
        assert list(generate(m32, p, greedy(N), decoder=decoder)) == full_recompute_greedy(
            m32, p, N
        )
    assert len(decoder._graphs) == 1 and decoder._direct is not None
