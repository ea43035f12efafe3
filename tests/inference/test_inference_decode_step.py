"""The engine's decode-only step (``lmstack.inference.decode_step``): attention through block tables
against SDPA over keys assembled slot by slot, the eager step on the engine's path, and the compiled
step (buckets, padding rows) against full recompute with preemption, prefix caching, chunked prefill
and abort — with no recompilation after warm-up."""

import pytest
import torch
import torch.nn.functional as F
from inference_helpers import full_recompute_greedy, greedy, make_model

from lmstack.inference import LLM, LLMEngine
from lmstack.inference.decode_step import DecodeBatch, DecodeStep, batch_bucket
from lmstack.inference.paged import PagedKVCache
from lmstack.inference.paged_attention import paged_decode_attention
from lmstack.model.seam import AttentionMetadata, SDPAAttention, reference_attention


def _slot(cache, which, r, block, off):
    """One stored key/value row (K, H), dequantised by hand for an int8 pool: code · scale of its block."""
    store = cache.k if which == "k" else cache.v
    if cache.quant is None:
        return store[r, block, off].double()
    scale = (cache.k_scale if which == "k" else cache.v_scale)[r, block]  # (K,)
    return store[r, block, off].double() * scale.double()[:, None]


PATHS = [
    "eager",
    "paged",
    pytest.param("paged_compiled", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kv_dtype", [torch.float64, "int8"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("path", PATHS)
def test_decode_attention_through_random_block_tables(kv_dtype, window, path):
    """eager (``DecodeBatch``): k, v stored in the pool first (read back with the blocks); paged (the
    compiled step's ``paged_decode_attention``, eagerly and compiled): the blocks read in place through the
    table with this token's k, v put at its slot, the pool left as it was."""
    model = make_model()
    c = model.config
    bs, NB, K, H, N = 4, 40, c.n_kv_heads, c.head_dim, c.n_heads
    cache = PagedKVCache(c, NB, bs, kv_dtype)
    g = torch.Generator().manual_seed(0)
    for layer in range(c.n_layers):  # every slot holds something (int8: codes and scales)
        cache.write(
            layer,
            torch.arange(NB * bs),
            torch.randn(NB * bs, K, H, generator=g, dtype=torch.float64),
            torch.randn(NB * bs, K, H, generator=g, dtype=torch.float64),
        )
    # fragmented tables, rows 0 and 1 share their first two blocks (a cached prefix), row 2 has one block
    tables = [[17, 3, 29, 8], [17, 3, 11], [5]]
    positions = [13, 9, 2]  # the fed token's position: inside the table's last block
    M = 5
    table = torch.tensor([t + [0] * (M - len(t)) for t in tables])
    pos = torch.tensor(positions)
    B = len(tables)
    q = torch.randn(B, N, 1, H, generator=g, dtype=torch.float64)
    k = torch.randn(B, K, 1, H, generator=g, dtype=torch.float64)
    v = torch.randn(B, K, 1, H, generator=g, dtype=torch.float64)
    layer = 1
    eager = path == "eager"
    slots = torch.tensor([tables[b][p // bs] * bs + p % bs for b, p in enumerate(positions)])
    before = cache.k.clone()
    if eager:
        batch = DecodeBatch(cache, table, pos, slots)
        out = batch.attend(
            layer, q, k, v, AttentionMetadata(pos[:, None], window=window), SDPAAttention()
        )
    else:
        fn = paged_decode_attention
        if path == "paged_compiled":
            fn = torch.compile(fn, fullgraph=True, dynamic=False)
        scales = (None, None) if cache.quant is None else (cache.k_scale[1], cache.v_scale[1])
        out = fn(
            q, cache.k[1], cache.v[1], table, pos, k[:, :, 0], v[:, :, 0], window, None, *scales
        )
    assert torch.equal(cache.k, before) != eager  # written in place only eagerly
    for b in range(B):
        p = positions[b]
        lo = 0 if window is None else max(0, p - window + 1)
        last = (
            p + 1 if eager else p
        )  # eagerly the token's own k, v are read back from the pool (int8: quantised)
        ks = [_slot(cache, "k", layer, tables[b][j // bs], j % bs) for j in range(lo, last)]
        vs = [_slot(cache, "v", layer, tables[b][j // bs], j % bs) for j in range(lo, last)]
        if not eager:
            ks, vs = ks + [k[b, :, 0]], vs + [v[b, :, 0]]
        kb = torch.stack(ks, dim=1).repeat_interleave(N // K, dim=0)  # (N, S_b, H)
        vb = torch.stack(vs, dim=1).repeat_interleave(N // K, dim=0)
        ref = F.scaled_dot_product_attention(q[b], kb, vb)  # (N, 1, H): every listed key visible
        tol = 1e-9 if cache.quant is None else 1e-6  # an int8 pool dequantises in float32
        torch.testing.assert_close(out[b], ref, rtol=tol, atol=tol)


def test_paged_decode_attention_soft_caps_scores_like_the_reference():
    """Gemma-2's soft-cap c·tanh(s/c) before the mask, against ``reference_attention`` on gathered keys."""
    g = torch.Generator().manual_seed(1)
    NB, bs, K, H, N, B = 6, 4, 2, 8, 4, 2
    kp, vp = (torch.randn(NB, bs, K, H, generator=g, dtype=torch.float64) for _ in range(2))
    table, pos = torch.tensor([[4, 1], [2, 0]]), torch.tensor([6, 3])
    q = torch.randn(B, N, 1, H, generator=g, dtype=torch.float64) * 4
    out = paged_decode_attention(q, kp, vp, table, pos, softcap=2.0)
    ks = kp[table].flatten(1, 2).transpose(1, 2)  # (B, K, S, H)
    vs = vp[table].flatten(1, 2).transpose(1, 2)
    mask = (torch.arange(8)[None] <= pos[:, None])[:, None, None]  # (B, 1, 1, S)
    torch.testing.assert_close(out, reference_attention(q, ks, vs, mask, softcap=2.0))


def test_batch_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 7, 9, 13, 16, 17, 33, 49, 64, 65, 130)] == [
        1,
        2,
        4,
        6,
        8,
        12,
        16,
        16,
        24,
        48,
        64,
        64,
        128,
        192,
    ]
    assert [batch_bucket(n, (2, 4)) for n in (1, 3, 5, 9)] == [2, 4, 8, 12]


def test_engine_decode_iterations_go_through_the_decode_step(model, prompts, monkeypatch):
    calls = []
    forward = DecodeStep.forward

    def counted(self, tokens, positions, tables):
        calls.append(len(tokens))
        return forward(self, tokens, positions, tables)

    monkeypatch.setattr(DecodeStep, "forward", counted)
    llm = LLM(model, block_size=4, max_num_seqs=4)
    out = llm.generate(prompts[:6], greedy(8))
    assert [o.token_ids for o in out] == [full_recompute_greedy(model, p, 8) for p in prompts[:6]]
    assert calls and max(calls) == 4  # decode-only iterations of 4 rows, and the tails with fewer


def test_compile_is_refused_where_the_step_cannot_serve(model):
    with pytest.raises(ValueError, match="compile=True"):
        LLMEngine(model, selective=False, compile=True)


@pytest.fixture(scope="module")
def compiled():
    """One compiled engine for every scenario below (each bucket compiles once: tens of seconds on a CPU)."""
    model = make_model()
    # 14 blocks of 4: one sequence always fits, three running ones get preempted; 8-token budget: chunked prefill
    llm = LLM(
        model,
        block_size=4,
        num_blocks=14,
        max_num_seqs=3,
        max_num_batched_tokens=8,
        compile={"cpp_wrapper": False},
    )
    llm.engine.runner.decode.buckets = (2, 4)  # two compilations: 1-2 rows pad to 2, 3 rows to 4
    llm.engine.warm_up()
    return model, llm


@pytest.mark.slow
def test_compiled_decode_equals_full_recompute_across_buckets(compiled, prompts):
    model, llm = compiled
    decode = llm.engine.runner.decode
    assert decode.graphs == 2  # buckets 2 and 4 at one table bucket, one graph for all layers
    assert all(
        decode.regional._direct.values()
    )  # each called directly after its checked first call
    # through inductor's own entry (one list of inputs), not the AOT runtime wrapper around it
    assert all(boxed for _, _, boxed in decode.regional._direct.values())
    chosen = (
        prompts[:4] + prompts[8:11] + prompts[-4:]
    )  # short, across blocks, long (chunked), shared prefixes
    out = llm.generate(chosen, greedy(12))
    assert [o.token_ids for o in out] == [full_recompute_greedy(model, p, 12) for p in chosen]
    assert llm.engine.stats["preemptions"] > 0
    assert (
        sum(o.num_cached_tokens for o in llm.generate(chosen[-4:], greedy(2))) > 0
    )  # prefix cache hits
    assert decode.graphs == 2  # no recompilation after warm-up


@pytest.mark.slow
def test_compiled_decode_with_abort(compiled, prompts):
    model, llm = compiled
    engine = llm.engine
    chosen = prompts[4:7]
    for i, p in enumerate(chosen):
        engine.add_request(f"a{i}", p, greedy(10))
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        if steps == 6:
            assert engine.abort_request("a1")
    assert (
        "a1" not in done and "a1" not in engine.requests
    )  # aborted mid-decode, gone from the engine
    for i in (0, 2):
        assert done[f"a{i}"].token_ids == full_recompute_greedy(model, chosen[i], 10)
    assert engine.runner.decode.graphs == 2
    assert not engine.cache.blocks.tables  # every block table given back


def test_fused_projections_equal_the_separate_linears():
    import copy

    model = make_model(qkv_bias=True)
    plain = copy.deepcopy(model)
    assert model.fuse_projections() == 2 * model.config.n_layers  # every attention and SwiGLU
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), plain(tokens), rtol=1e-12, atol=1e-12)
        # in-place updates of the separate parameters reach the fused weights (load_state_dict copies in place)
        state = {k: v + 0.01 * torch.randn_like(v) for k, v in plain.state_dict().items()}
        plain.load_state_dict(state)
        model.load_state_dict(state)
        torch.testing.assert_close(model(tokens), plain(tokens), rtol=1e-12, atol=1e-12)
        # a replaced parameter: the layer goes back to its separate linears
        attn = model.blocks[0].attn
        attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight * 2)
        plain.blocks[0].attn.k_proj.weight.mul_(2)
        torch.testing.assert_close(model(tokens), plain(tokens), rtol=1e-12, atol=1e-12)

        # a replaced module (a wrapper, as LoRA or quantisation puts in): its SwiGLU uses the new modules
        class Scaled(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return 3 * self.inner(x)

        model.blocks[1].ffn.up_proj = Scaled(model.blocks[1].ffn.up_proj)
        plain.blocks[1].ffn.up_proj = Scaled(plain.blocks[1].ffn.up_proj)
        torch.testing.assert_close(model(tokens), plain(tokens), rtol=1e-12, atol=1e-12)
    assert list(model.state_dict()) == list(plain.state_dict())  # checkpoints unchanged


def test_fused_projections_leave_training_gradients_to_every_parameter():
    """LLM(model) fuses q/k/v and gate/up in place; the same model trained afterwards (GRPO serves and trains one
    model) must still send gradients to q_proj/k_proj/v_proj/gate_proj/up_proj — equal to an unfused copy's."""
    import copy

    from lmstack.model.config import ModelConfig
    from lmstack.model.transformer import Transformer

    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32
    )
    ref = Transformer(cfg, seed=0).double()
    fused = copy.deepcopy(ref)
    assert fused.fuse_projections() == 4
    x = torch.randint(0, 64, (2, 8))
    ref(x).square().mean().backward()
    fused(x).square().mean().backward()
    grads = dict(ref.named_parameters())
    for name, p in fused.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, grads[name].grad)
    with torch.no_grad():  # and inference through the fused GEMMs gives the same logits
        torch.testing.assert_close(fused(x), ref(x))


def test_compile_policy_auto_follows_the_device_and_the_compiler(monkeypatch):
    import shutil

    import lmstack.inference.decode_step as ds

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert ds.compile_policy("auto", "cpu")[0] is True
    assert ds.compile_policy("auto", "cuda")[0] is False  # compiled step untested there
    assert (
        ds.compile_policy("on", "cuda")[0] is True and ds.compile_policy("off", "cpu")[0] is False
    )
    assert ds.compile_policy({"cpp_wrapper": False}, "cpu")[0] == {"cpp_wrapper": False}
    monkeypatch.setattr(shutil, "which", lambda name: None)
    compiled, reason = ds.compile_policy("auto", "cpu")
    assert compiled is False and "C++ compiler" in reason
    with pytest.raises(ValueError, match="compile='fast'"):
        ds.compile_policy("fast", "cpu")


def test_auto_compile_stays_eager_where_there_is_no_decode_step(model):
    engine = LLMEngine(model, selective=False, compile="auto")  # "on" refuses this (above)
    assert engine.runner.decode is None and "eager" in engine.compile_reason


@pytest.mark.slow
def test_batches_above_max_compiled_batch_run_eagerly(compiled, prompts, monkeypatch):
    model, llm = compiled
    decode = llm.engine.runner.decode
    calls = []
    eager = DecodeStep._eager
    monkeypatch.setattr(
        DecodeStep, "_eager", lambda self, tok, *a: calls.append(len(tok)) or eager(self, tok, *a)
    )
    monkeypatch.setattr(decode, "max_compiled_batch", 2)
    chosen = prompts[4:7]
    out = llm.generate(chosen, greedy(6))
    assert [o.token_ids for o in out] == [full_recompute_greedy(model, p, 6) for p in chosen]
    assert calls and min(calls) == 3  # the 3-row steps eagerly (unpadded); 1-2 rows compiled
    assert decode.graphs == 2


@pytest.mark.slow
def test_compiled_decode_keeps_a_graph_per_kind_of_block():
    """Local (window, own RoPE base) and global layers differ in constants the traced graph bakes in: they
    get a graph each (not one graph called with the other kind's tensors), and greedy output equals full
    recompute."""
    model = make_model(
        n_layers=3,
        layer_types=["local_attention", "attention", "local_attention"],
        local_window=5,
        local_rope_theta=100.0,
        attn_softcap=5.0,
    )
    llm = LLM(model, block_size=4, max_num_seqs=2, compile={"cpp_wrapper": False})
    decode = llm.engine.runner.decode
    decode.buckets = (2,)
    assert (
        decode.regional.signatures[0]
        == decode.regional.signatures[2]
        != decode.regional.signatures[1]
    )
    g = torch.Generator().manual_seed(0)
    chosen = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 9)]
    out = llm.generate(chosen, greedy(10))
    assert [o.token_ids for o in out] == [full_recompute_greedy(model, p, 10) for p in chosen]
    assert decode.graphs == 2 and all(decode.regional._direct.values())


@pytest.mark.slow
def test_a_direct_call_that_disagrees_falls_back_to_the_wrapped_graph(monkeypatch):
    """Inductor's entry is used only after one call that equals Dynamo's: one that returns something else
    (faked here) leaves the wrapped graph, and greedy output still equals the full recompute."""
    from lmstack.inference import regional

    monkeypatch.setattr(
        regional, "inner_graph", lambda graph, inputs: lambda args: [torch.zeros(1)] * 4
    )
    model = make_model(n_layers=2, seed=3)
    llm = LLM(model, block_size=4, max_num_seqs=2, compile={"cpp_wrapper": False})
    decode = llm.engine.runner.decode
    decode.buckets = (2,)
    g = torch.Generator().manual_seed(1)
    chosen = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (4, 7)]
    out = llm.generate(chosen, greedy(8))
    assert [o.token_ids for o in out] == [full_recompute_greedy(model, p, 8) for p in chosen]
    assert decode.regional._direct and all(d and not d[2] for d in decode.regional._direct.values())


@pytest.mark.slow
@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_compiled_decode_makes_no_graph_as_tables_grow(path):
    """Sequences that cross table buckets after ``warm_up`` compile nothing new: with the torch formula
    (a float64 model) every table bucket is compiled at warm-up; with the C++ kernel (float32) one graph
    per batch bucket takes the whole max_model_len table. Greedy output equals full recompute."""
    from lmstack.inference import paged_kernel

    if path == "kernel" and paged_kernel.selected()[0] == "torch":
        pytest.skip(f"paged kernel off: {paged_kernel.selected()[1]}")
    dtype = torch.float64 if path == "torch" else torch.float32
    model = make_model(dtype=dtype, init_std=0.2)  # peaked logits: no near-ties in fp32
    llm = LLM(model, block_size=4, max_num_seqs=2, max_model_len=48, compile={"cpp_wrapper": False})
    decode = llm.engine.runner.decode
    decode.buckets = (2,)
    decode.min_blocks = 2  # table buckets of 2, 4, 8 and 12 blocks (max_model_len 48 = 12 blocks)
    assert decode.full_table == (path == "kernel")
    llm.engine.warm_up()
    warm = 1 if path == "kernel" else 4  # one graph per table bucket of the one batch bucket
    assert decode.graphs == warm
    g = torch.Generator().manual_seed(3)
    chosen = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 9)]
    out = llm.generate(chosen, greedy(30))  # up to 39 positions: tables of 1 .. 10 blocks
    assert [o.token_ids for o in out] == [full_recompute_greedy(model, p, 30) for p in chosen]
    assert decode.graphs == warm  # no compilation while serving
