"""The static-cache batch-1 path (eager and torch.compile'd decode step): greedy output equals the
full recompute token for token; one decoder serves several prompts."""

import pytest
import torch
from inference_helpers import full_recompute_greedy, greedy, make_model

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


def test_static_cache_pool_layout(model):
    """``block_size``: slots padded to whole blocks, each layer a paged pool (blocks of the one row in order)
    whose slot s holds position s; ``update`` returns (B, K, S, H) views equal to what was written, ``store``
    writes one step of every layer."""
    cfg = model.config
    L, K, H = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    cache = StaticKVCache(cfg, 1, 40, dtype=torch.float32, block_size=16)  # 40 -> 48 slots
    assert cache.nbytes == kv_cache_bytes(cfg, 1, 48, "fp32") and cache.table.tolist() == [
        [0, 1, 2]
    ]
    k = torch.randn(1, K, 3, H)
    k_all, v_all, pos = cache.update(0, k, -k, torch.tensor([0, 1, 2]))  # layer 0 writes positions
    assert k_all.shape == (1, K, 40, H) and pos.shape == (1, 40)
    assert torch.equal(k_all[:, :, :3], k) and torch.equal(v_all[:, :, :3], -k)
    kp, vp = cache.pool(0)
    assert kp.shape == (3, 16, K, H) and torch.equal(kp[0, :3], k[0].transpose(0, 1))
    new = torch.randn(L, 1, K, H)
    cache.store(torch.tensor([17]), new, 2 * new)  # slot 17: block 1, offset 1
    for layer in range(L):
        kp, vp = cache.pool(layer)
        assert torch.equal(kp[1, 1], new[layer, 0]) and torch.equal(vp[1, 1], 2 * new[layer, 0])
    assert pos[0, :4].tolist() == [0, 1, 2, -1] and pos[0, 17] == 17
    with pytest.raises(ValueError, match="block_size=0"):
        StaticKVCache(cfg, 1, 40, block_size=0)


def test_static_decoder_greedy_equals_full_recompute(model, prompts):
    decoder = StaticDecoder(model, 64)  # reused (reset) across all prompts
    for p in prompts:
        assert list(generate(model, p, greedy(N), decoder=decoder)) == full_recompute_greedy(
            model, p, N
        )


def test_static_decoder_fuses_projections_and_still_equals_the_unfused_model(prompts):
    """q/k/v and gate/up fused by default (as the engine): the logits of every step equal the unfused
    model's full recompute (float64: to 1e-12), and ``fuse_projections=False`` leaves the model as it was."""
    import copy

    model = make_model()
    unfused = copy.deepcopy(model)
    kept = StaticDecoder(copy.deepcopy(model), 64, fuse_projections=False)
    assert all(b.attn.qkv is None for b in kept.model.blocks)
    decoder = StaticDecoder(model, 64)
    assert all(b.attn.qkv is not None for b in model.blocks)
    p = prompts[-4]
    with torch.inference_mode():
        got = [decoder.prefill(p)]
        ids = list(p)
        for _ in range(4):
            ids.append(int(got[-1].argmax()))
            got.append(decoder.decode(torch.tensor([[ids[-1]]]), torch.tensor([len(ids) - 1])))
        want = unfused(torch.tensor([ids]))[0, len(p) - 1 :]
    torch.testing.assert_close(torch.stack(got), want, rtol=0, atol=1e-12)


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
def test_compiled_decoder_groups_of_blocks_equal_full_recompute(prompts):
    """``group``: consecutive blocks per graph. 5 layers in groups of 2 are two graphs (a pair, shared by
    layers 0-1 and 2-3, and the last layer alone), both called directly; greedy tokens equal the full
    recompute's and the logits the eager model's; more prompts compile nothing more."""
    torch._dynamo.reset()
    model = make_model(n_layers=5, seed=3)
    decoder = StaticDecoder(model, 64, compile=True, group=2)
    assert decoder.regional.groups == [(0, 1), (2, 3), (4,)]
    for p in prompts[:3] + prompts[-2:]:
        assert list(generate(model, p, greedy(N), decoder=decoder)) == full_recompute_greedy(
            model, p, N
        )
    assert decoder.graphs == 2 and all(decoder.regional._direct.values())
    p = prompts[4]
    decoder.reset()
    decoder.prefill(p)
    with torch.no_grad():
        want = model(torch.tensor([p + [7]]))[0, -1]
    torch.testing.assert_close(
        decoder.decode(torch.tensor([[7]]), torch.tensor([len(p)])), want, rtol=0, atol=1e-10
    )
    assert decoder.graphs == 2
    with pytest.raises(ValueError, match="group=0"):
        StaticDecoder(model, 64, compile=True, group=0)


@pytest.mark.slow
def test_compiled_decoder_greedy_equals_full_recompute(model, prompts):
    torch._dynamo.reset()
    decoder = StaticDecoder(model, 64, compile=True)
    assert decoder.regional is not None and decoder.cache.block_size == 16  # the default: per block
    for p in prompts[:6] + prompts[-3:]:
        assert list(generate(model, p, greedy(N), decoder=decoder)) == full_recompute_greedy(
            model, p, N
        )
    # one graph for both (identical) blocks, called directly after its checked first call
    assert decoder.graphs == 1 and all(decoder.regional._direct.values())
    guarded = StaticDecoder(
        model, 64, compile=True, direct=False
    )  # Dynamo's guarded call on every block of every step
    p = prompts[0]
    assert list(generate(model, p, greedy(N), decoder=guarded)) == full_recompute_greedy(
        model, p, N
    )
    assert guarded.regional._direct and not any(guarded.regional._direct.values())
    # int32 ids are taken as long (no second graph); other shapes are refused by name
    logits = decoder.decode(torch.tensor([[5]]), torch.tensor([0]))
    torch.testing.assert_close(
        decoder.decode(torch.tensor([[5]], dtype=torch.int32), torch.tensor([0])), logits
    )
    assert decoder.graphs == 1
    with pytest.raises(ValueError, match=r"token \(1, 1\).*got \(1, 2\)"):
        decoder.decode(torch.tensor([[5, 6]]), torch.tensor([0]))
    # Dynamo keeps its backends for the life of the process; they must not keep a decoder (and its model) alive
    import gc
    import weakref

    ref = weakref.ref(decoder)
    del decoder
    gc.collect()
    assert ref() is None


@pytest.mark.slow
def test_compiled_decoder_compiles_one_graph_per_kind_of_block():
    """Regional compilation: local (window, own RoPE base) and global layers differ in constants their graphs
    bake in, so 4 layers of 2 kinds compile 2 graphs (counted by the decoder and by Dynamo), each shared by
    its layers and called directly; later steps and prompts compile nothing. Greedy output equals the full
    recompute, in fp32 (the C++ paged kernel reads slots 0 .. p) and float64 (the torch formula)."""
    from torch._dynamo.utils import counters

    for dtype in (torch.float32, torch.float64):
        model = make_model(
            n_layers=4,
            dtype=dtype,
            init_std=0.2,  # peaked logits: no near-ties in fp32
            layer_types=["local_attention", "attention", "local_attention", "attention"],
            local_window=5,
            local_rope_theta=100.0,
        )
        torch._dynamo.reset()
        counters.clear()
        decoder = StaticDecoder(
            model, 64, compile=True, compile_options={"cpp_wrapper": False}, group=1
        )
        sig = decoder.regional.signatures
        assert sig[0] == sig[2] != sig[1] == sig[3]
        decoder.warm_up()
        assert decoder.graphs == 2 and counters["stats"]["unique_graphs"] == 2
        g = torch.Generator().manual_seed(0)
        for n in (3, 9, 20):  # past the window, across 16-slot blocks of the pool layout
            p = torch.randint(0, 97, (n,), generator=g).tolist()
            assert list(generate(model, p, greedy(12), decoder=decoder)) == full_recompute_greedy(
                model, p, 12
            ), (dtype, n)
        assert decoder.graphs == 2 and counters["stats"]["unique_graphs"] == 2  # no recompilation
        assert all(decoder.regional._direct.values())


@pytest.mark.slow
def test_whole_model_compiled_decoder_greedy_equals_full_recompute(model, prompts):
    """``regional=False``: the whole step as one graph over the (B, K, S, H) cache, called directly; a step
    unlike the traced one (int32 ids) goes through Dynamo (a recompile), not the captured graph."""
    torch._dynamo.reset()
    decoder = StaticDecoder(model, 64, compile=True, regional=False)
    assert decoder.regional is None and decoder.cache.block_size is None
    for p in prompts[:3] + prompts[-2:]:
        assert list(generate(model, p, greedy(N), decoder=decoder)) == full_recompute_greedy(
            model, p, N
        )
    assert decoder.graphs == 1 and decoder._direct is not None
    logits = decoder.decode(torch.tensor([[5]]), torch.tensor([0]))
    torch.testing.assert_close(
        decoder.decode(torch.tensor([[5]], dtype=torch.int32), torch.tensor([0])), logits
    )
    assert decoder.graphs == 2


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
    eagerly after the whole-model graph (and, as always, after the block graphs of the regional step):
    greedy output equals the full recompute (oneDNN at every row count there too), one graph, called
    directly."""
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
    decoder = StaticDecoder(m32, 64, compile=True, regional=False)
    assert decoder._eager_head
    regional = StaticDecoder(m32, 64, compile=True)  # per block: the head is always eager there
    for p in prompts[:3]:
        want = full_recompute_greedy(m32, p, N)
        assert list(generate(m32, p, greedy(N), decoder=decoder)) == want
        assert list(generate(m32, p, greedy(N), decoder=regional)) == want
    assert len(decoder._graphs) == 1 and decoder._direct is not None
    assert regional.graphs == 1
