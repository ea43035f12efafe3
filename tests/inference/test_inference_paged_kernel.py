"""lmstack's C++ paged decode attention (``inference.paged_kernel``, ``csrc/paged_decode.cpp``) against
``F.scaled_dot_product_attention`` over keys assembled slot by slot from the block table (float64), on
fragmented and shared-prefix tables, rows of different lengths (a position at a block boundary, rows over
several 16-slot tiles), window, soft-cap, GQA, float32 / bf16 pools and int8 / fp8 codes with scales; its
fake shape under torch.compile; the variant choice and fallback; and the engine's eager and compiled
decode steps with the kernel against full recompute."""

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from inference_helpers import full_recompute_greedy, greedy, make_model

from lmstack.cpu import probe
from lmstack.inference import LLM, paged_kernel
from lmstack.inference.decode_step import DecodeBatch
from lmstack.inference.paged import PagedKVCache
from lmstack.inference.paged_attention import decode_attention
from lmstack.model.seam import AttentionMetadata, SDPAAttention, reference_attention

NB, BS, K, G, H = 24, 4, 2, 3, 20  # H = 20: vector tails; G = 3 query heads per KV head
N = K * G
NAN_BLOCK = NB - 1  # holds NaN: the tables' padding points at it, so a kernel reading padding fails
# fragmented tables; rows 0, 1, 3 share their first two blocks (a cached prefix); row 1's position opens a
# block, row 3's closes one, row 2 is at position 0, row 4 spans three 16-slot tiles
TABLES = [[17, 3, 9, 8], [17, 3, 11], [5], [17, 3], [2, 4, 6, 10, 12, 14, 16, 18, 20, 1]]
POSITIONS = [13, 8, 0, 7, 37]
M = 12


def _variants():
    cpu = probe()
    chosen = paged_kernel.choose_variant(cpu.flags, cpu.arch, "auto")[0]
    out = []
    for v in paged_kernel.VARIANTS:
        if paged_kernel.choose_variant(cpu.flags, cpu.arch, v)[0] == v:
            out.append(v if v == chosen else pytest.param(v, marks=pytest.mark.slow))
    return out


VARIANTS = _variants()


def _built(variant):
    why = paged_kernel.build(variant)
    if why is not None:
        pytest.skip(f"paged kernel {variant} not built: {why}")
    return variant


def _pool(dtype, g, H=H):
    """K and V pools (NB, BS, K, H) in ``dtype`` (int8/fp8: codes with scales (NB, K)) and their float64
    values; block NAN_BLOCK is NaN."""
    vals, out, scales = [], [], []
    for _ in range(2):
        x = torch.randn(NB, BS, K, H, generator=g, dtype=torch.float64)
        if dtype in (torch.int8, torch.float8_e4m3fn):
            s = torch.rand(NB, K, generator=g, dtype=torch.float64) * 0.05 + 0.01
            s[NAN_BLOCK] = float("nan")
            if dtype == torch.int8:
                codes = torch.randint(-127, 128, (NB, BS, K, H), generator=g, dtype=torch.int8)
            else:
                codes = (x * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
            out.append(codes)
            scales.append(s.float())
            vals.append(codes.double() * s.float().double()[:, None, :, None])
        else:
            x[NAN_BLOCK] = float("nan")
            out.append(x.to(dtype))
            vals.append(out[-1].double())
    sc = (scales[0], scales[1]) if scales else (None, None)
    return out[0], out[1], sc, vals[0], vals[1]


def _table():
    return torch.tensor([t + [NAN_BLOCK] * (M - len(t)) for t in TABLES])


def _reference(q, kv, vv, k_new, v_new, window, softcap=None, G=G):
    """Per row: SDPA (float64) over the visible slots' keys picked one by one through the table."""
    outs = []
    for b, (t, p) in enumerate(zip(TABLES, POSITIONS)):
        lo = 0 if window is None else max(0, p - window + 1)
        last = p if k_new is not None else p + 1
        ks = [kv[t[s // BS], s % BS] for s in range(lo, last)]  # each (K, H)
        vs = [vv[t[s // BS], s % BS] for s in range(lo, last)]
        if k_new is not None:
            ks, vs = ks + [k_new[b].double()], vs + [v_new[b].double()]
        kb = torch.stack(ks, dim=1).repeat_interleave(
            G, dim=0
        )  # (N, S_b, H): head n reads KV n // G
        vb = torch.stack(vs, dim=1).repeat_interleave(G, dim=0)
        if softcap is None:
            outs.append(F.scaled_dot_product_attention(q[b].double(), kb, vb))  # (N, 1, H)
        else:
            outs.append(
                reference_attention(q[b : b + 1].double(), kb[None], vb[None], None, softcap)[0]
            )
    return torch.stack(outs)  # (B, N, 1, H)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn],
    ids=str,
)
@pytest.mark.parametrize("new", [False, True], ids=["pool", "k_new"])
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_equals_sdpa_over_the_tables_slots(variant, dtype, new, window):
    _built(variant)
    g = torch.Generator().manual_seed(hash((str(dtype), new, window)) % 1000)
    kp, vp, (ks, vs), kv, vv = _pool(dtype, g)
    B = len(TABLES)
    q = (
        torch.randn(B, N, 1, H, generator=g) * 3
    )  # peaked scores: the running max moves between tiles
    k_new = torch.randn(B, K, H, generator=g) if new else None
    v_new = torch.randn(B, K, H, generator=g) if new else None
    table, pos = _table(), torch.tensor(POSITIONS)
    out = paged_kernel.paged_decode(
        q, kp, vp, table, pos, k_new, v_new, window, None, ks, vs, variant=variant
    )
    assert out.shape == (B, N, 1, H) and out.dtype == torch.float32
    ref = _reference(q, kv, vv, k_new, v_new, window)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


class GroupCase(NamedTuple):
    """One group-size / head-dim case: pools and their float64 values (``_pool``), the tables, q and this
    step's key and value."""

    kp: torch.Tensor  # (NB, BS, K, h_) stored dtype
    vp: torch.Tensor
    ks: torch.Tensor | None  # (NB, K) scales of int8 / fp8 codes, else None
    vs: torch.Tensor | None
    kv: torch.Tensor  # (NB, BS, K, h_) float64 values
    vv: torch.Tensor
    q: torch.Tensor  # (B, K g_, 1, h_), times 3: peaked scores
    k_new: torch.Tensor  # (B, K, h_)
    v_new: torch.Tensor
    table: torch.Tensor  # (B, M) TABLES padded with NAN_BLOCK
    pos: torch.Tensor  # (B,) POSITIONS

    @property
    def inputs(self):
        """``paged_kernel.paged_decode``'s first seven arguments (q, pools, table, positions, k_new, v_new)."""
        return self.q, self.kp, self.vp, self.table, self.pos, self.k_new, self.v_new


def _group_case(dtype, seed, g_, h_):
    """``GroupCase`` for ``g_`` query heads per KV head and head dim ``h_``, drawn from a generator seeded
    ``seed`` (pools, then q, then k_new, v_new)."""
    g = torch.Generator().manual_seed(seed)
    kp, vp, (ks, vs), kv, vv = _pool(dtype, g, H=h_)
    B = len(TABLES)
    q = torch.randn(B, K * g_, 1, h_, generator=g) * 3
    k_new, v_new = torch.randn(B, K, h_, generator=g), torch.randn(B, K, h_, generator=g)
    return GroupCase(kp, vp, ks, vs, kv, vv, q, k_new, v_new, _table(), torch.tensor(POSITIONS))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str
)
@pytest.mark.parametrize("g_, h_", [(1, 64), (2, 16), (4, 33), (5, 72), (9, 8)])
def test_kernel_equals_sdpa_for_each_group_size_and_head_dim(variant, dtype, g_, h_):
    """G = 1 (MHA) to 9 query heads per KV head (the kernel's groups of 4 and their remainders), H a
    multiple of 16 or not (a masked tail chunk), with this step's k_new."""
    _built(variant)
    c = _group_case(dtype, 100 * g_ + h_, g_, h_)
    out = paged_kernel.paged_decode(*c.inputs, None, None, c.ks, c.vs, variant=variant)
    ref = _reference(c.q, c.kv, c.vv, c.k_new, c.v_new, None, G=g_)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn],
    ids=str,
)
@pytest.mark.parametrize(
    "g_, h_, window, softcap",
    [
        (3, 64, None, None),
        (3, 64, 6, 3.0),
        (4, 128, None, None),
        (5, 128, 9, None),
        (3, 80, None, 2.0),
    ],
)
def test_kernel_equals_sdpa_at_compiled_head_dims_with_window_and_soft_cap(
    variant, dtype, g_, h_, window, softcap
):
    """The head dims the vector builds compile their chunk counts for (H = 64: SmolLM2's 3 query heads per
    KV head; H = 128 with groups of 4 and 4 + 1) and a run-time one (H = 80), every pool dtype (int8 / fp8
    scales), a window and a soft-cap, with this step's k_new."""
    _built(variant)
    c = _group_case(dtype, 7 * g_ + h_ + (window or 0), g_, h_)
    out = paged_kernel.paged_decode(*c.inputs, window, softcap, c.ks, c.vs, variant=variant)
    ref = _reference(c.q, c.kv, c.vv, c.k_new, c.v_new, window, softcap, G=g_)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn],
    ids=str,
)
@pytest.mark.parametrize("h_", [20, 33])
def test_kernel_reads_no_value_past_a_rows_tail(variant, dtype, h_):
    """H not a multiple of 8 (or 16): the last KV head of block 0's last slot is followed in memory by NaN
    block 1, so a key's tail chunk read past H would make the scores NaN (the in-place builds read the last
    H % 8 or H % 16 values alone; reading 8 made 8 of these cases fail). int8 has no NaN code: its case
    checks the values only."""
    _built(variant)
    g = torch.Generator().manual_seed(h_)
    x = torch.randn(2, 2, BS, K, h_, generator=g, dtype=torch.float64)
    codes = dtype in (torch.int8, torch.float8_e4m3fn)
    stored = (x * 20).clamp(-127, 127).to(dtype) if codes else x.to(dtype)
    if dtype == torch.float8_e4m3fn:
        stored[:, 1] = torch.tensor(float("nan")).to(dtype)
    elif codes:
        stored[:, 1] = 127  # int8 has no NaN: its block 1's scale is NaN instead
    else:
        stored[:, 1] = float("nan")
    scale = torch.tensor([[0.02, 0.03], [float("nan")] * 2]) if codes else None
    vals = stored.double() * (scale.double()[:, None, :, None] if codes else 1)
    q = torch.randn(1, K * 2, 1, h_, generator=g)
    out = paged_kernel.paged_decode(
        q,
        stored[0],
        stored[1],
        torch.tensor([[0]]),
        torch.tensor([BS - 1]),
        k_scale=scale,
        v_scale=scale,
        variant=variant,
    )
    kb = (
        vals[0, 0].transpose(0, 1).repeat_interleave(2, dim=0)
    )  # (N, BS, H): head n reads KV n // 2
    vb = vals[1, 0].transpose(0, 1).repeat_interleave(2, dim=0)
    ref = F.scaled_dot_product_attention(q[0].double(), kb, vb)  # (N, 1, H)
    torch.testing.assert_close(out[0].double(), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_reads_fp8_nan_and_subnormal_codes_as_torch_does(variant):
    """Every e4m3 code (subnormals, +-0, the NaN codes 0x7F / 0xFF) in the value rows: the kernel's
    conversion (AVX-512 / AVX2: through fp16's bit fields) against torch's ``float8_e4m3fn -> float32``."""
    _built(variant)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 1, 1, 16)
    ks = torch.ones(16, 1)
    q = torch.zeros(1, 1, 1, 16)  # equal scores: the output is the mean of the visible value rows
    for p in range(16):
        keys = torch.zeros_like(codes)  # (a NaN key would make every score NaN)
        out = paged_kernel.paged_decode(
            q,
            keys,
            codes,
            torch.arange(16)[None],
            torch.tensor([p]),
            k_scale=ks,
            v_scale=ks,
            variant=variant,
        )
        ref = codes[: p + 1, 0, 0].float().mean(0)
        torch.testing.assert_close(out[0, 0, 0], ref, equal_nan=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_soft_caps_and_keeps_a_bf16_query(variant):
    _built(variant)
    g = torch.Generator().manual_seed(3)
    kp, vp, _, kv, vv = _pool(torch.float32, g)
    B = len(TABLES)
    q = torch.randn(B, N, 1, H, generator=g) * 4
    k_new, v_new = torch.randn(B, K, H, generator=g), torch.randn(B, K, H, generator=g)
    table, pos = _table(), torch.tensor(POSITIONS)
    out = paged_kernel.paged_decode(q, kp, vp, table, pos, k_new, v_new, None, 2.0, variant=variant)
    torch.testing.assert_close(
        out.double(), _reference(q, kv, vv, k_new, v_new, None, 2.0), rtol=2e-5, atol=2e-5
    )
    qb = q.bfloat16()
    out = paged_kernel.paged_decode(qb, kp.bfloat16(), vp.bfloat16(), table, pos, variant=variant)
    assert out.dtype == torch.bfloat16
    ref = _reference(qb, kp.bfloat16().double(), vp.bfloat16().double(), None, None, None)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)  # bf16 output rounding


def test_kernel_on_two_threads_equals_one():
    """at::parallel_for over (row, KV head): each item computed alone, so the split changes no bit."""
    _kernel_on()
    g = torch.Generator().manual_seed(6)
    kp, vp, _, _, _ = _pool(torch.bfloat16, g)
    q = torch.randn(len(TABLES), N, 1, H, generator=g)
    args = (q, kp, vp, _table(), torch.tensor(POSITIONS))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_kernel.paged_decode(*args, window=9)
        torch.set_num_threads(2)
        two = paged_kernel.paged_decode(*args, window=9)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


def test_kernel_refuses_a_position_its_table_does_not_cover():
    variant = _built(VARIANTS[0] if isinstance(VARIANTS[0], str) else VARIANTS[0].values[0])
    kp = torch.zeros(NB, BS, K, H)
    q = torch.zeros(1, N, 1, H)
    with pytest.raises(RuntimeError, match="position 8 needs slots up to 9"):
        paged_kernel.paged_decode(
            q, kp, kp, torch.tensor([[1, 2]]), torch.tensor([8]), variant=variant
        )


def test_fake_shape_and_compiled_call_without_graph_break():
    _kernel_on()
    variant = paged_kernel.selected()[0]
    g = torch.Generator().manual_seed(4)
    kp, vp, _, _, _ = _pool(torch.float32, g)
    kp[NAN_BLOCK] = vp[NAN_BLOCK] = 0.0
    q = torch.randn(len(TABLES), N, 1, H, generator=g)
    op = getattr(torch.ops.lmstack_attn, f"paged_decode_{variant}")
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = (q.bfloat16(), kp, vp, _table(), torch.tensor(POSITIONS))
    with FakeTensorMode() as mode:
        out = op(*(mode.from_tensor(t) for t in args), None, None, None, None, 0, 0.0)
        assert out.shape == (len(TABLES), N, 1, H) and out.dtype == torch.bfloat16

    def f(q, table, pos):
        return decode_attention(q * 2, kp, vp, table, pos, window=6) + 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=False)  # fullgraph: a graph break raises
    table, pos = _table(), torch.tensor(POSITIONS)
    torch.testing.assert_close(compiled(q, table, pos), f(q, table, pos))


def test_canned_cpu_chooses_its_variant(monkeypatch):
    """LMSTACK_CPU=avx2 on an AVX-512 machine takes the avx2 build (as the int4/int8 choices do)."""
    from lmstack import cpu

    if "avx2" not in cpu.probe().flags:
        pytest.skip("this CPU cannot build the avx2 variant")
    monkeypatch.setenv("LMSTACK_CPU", "avx2")
    monkeypatch.delenv(paged_kernel.ENV, raising=False)
    paged_kernel.reset()
    try:
        assert paged_kernel.selected() == ("avx2", None)
    finally:
        monkeypatch.undo()
        paged_kernel.reset()


def test_choose_variant_follows_the_cpu_and_the_switch():
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx2"}
    assert paged_kernel.choose_variant(avx512, "x86_64") == ("avx512", None)
    assert paged_kernel.choose_variant({"avx2", "fma", "f16c"}, "x86_64") == ("avx2", None)
    assert paged_kernel.choose_variant({"sse2"}, "x86_64") == ("generic", None)
    assert paged_kernel.choose_variant({"asimd"}, "aarch64") == ("generic", None)
    assert paged_kernel.choose_variant(avx512, "x86_64", "torch")[0] == "torch"
    name, why = paged_kernel.choose_variant({"avx2", "fma", "f16c"}, "x86_64", "avx512")
    assert name == "torch" and "avx512f" in why
    with pytest.raises(ValueError, match="LMSTACK_PAGED_KERNEL"):
        paged_kernel.choose_variant(avx512, "x86_64", "fast")


def test_switch_and_build_failure_fall_back_to_the_torch_formula(monkeypatch, caplog):
    calls = []
    real = paged_kernel.paged_decode
    monkeypatch.setattr(paged_kernel, "paged_decode", lambda *a, **k: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(5)
    kp, vp, _, _, _ = _pool(torch.float32, g)
    kp[NAN_BLOCK] = vp[NAN_BLOCK] = 0.0  # the formula reads the padding
    q = torch.randn(len(TABLES), N, 1, H, generator=g)
    try:
        monkeypatch.setenv(paged_kernel.ENV, "torch")
        paged_kernel.reset()
        assert paged_kernel.selected() == ("torch", "LMSTACK_PAGED_KERNEL=torch")
        decode_attention(q, kp, vp, _table(), torch.tensor(POSITIONS))
        assert not calls
        monkeypatch.setenv(paged_kernel.ENV, "auto")
        monkeypatch.setattr(paged_kernel, "_built", {})
        monkeypatch.setattr(
            paged_kernel, "build_extension", lambda *a: (None, "no compiler (test)")
        )
        paged_kernel.reset()
        with caplog.at_level("WARNING", logger="lmstack.inference.paged_kernel"):
            name, why = paged_kernel.selected()
        assert name == "torch" and "no compiler (test)" in why and "kernel off" in caplog.text
        decode_attention(q, kp, vp, _table(), torch.tensor(POSITIONS))
        assert not calls
        # float64 queries take the formula (it computes in float64) even with the kernel on
        monkeypatch.undo()
        paged_kernel.reset()
        monkeypatch.setattr(paged_kernel, "paged_decode", lambda *a, **k: calls.append(1))
        if paged_kernel.selected()[0] != "torch":
            decode_attention(
                q.double(), kp.double(), vp.double(), _table(), torch.tensor(POSITIONS)
            )
            assert not calls
            decode_attention(q, kp, vp, _table(), torch.tensor(POSITIONS))
            assert calls
    finally:
        paged_kernel.reset()


@pytest.mark.parametrize("kv_dtype", [torch.float32, "int8"], ids=str)
def test_eager_decode_batch_kernel_equals_its_gather_and_sdpa(kv_dtype):
    """``DecodeBatch.attend`` with the kernel (the pool read in place) against ``kernel=False``: the layer's
    blocks gathered and torch's SDPA with the mask (window 5), the same stored k, v."""
    _kernel_on()
    model = make_model(dtype=torch.float32)
    c = model.config
    cache = PagedKVCache(c, NB, BS, kv_dtype)
    g = torch.Generator().manual_seed(7)
    for layer in range(c.n_layers):
        x = torch.randn(2, NB * BS, c.n_kv_heads, c.head_dim, generator=g)
        cache.write(layer, torch.arange(NB * BS), x[0], x[1])
    tables = [t[:4] for t in TABLES[:4]]
    positions = POSITIONS[:4]
    table = torch.tensor([t + [0] * (4 - len(t)) for t in tables])
    pos = torch.tensor(positions)
    slots = torch.tensor([t[p // BS] * BS + p % BS for t, p in zip(tables, positions)])
    B, N_, K_, H_ = len(tables), c.n_heads, c.n_kv_heads, c.head_dim
    q = torch.randn(B, N_, 1, H_, generator=g)
    k, v = torch.randn(B, K_, 1, H_, generator=g), torch.randn(B, K_, 1, H_, generator=g)
    meta = AttentionMetadata(pos[:, None], window=5)
    outs = []
    for kernel in (True, False):
        batch = DecodeBatch(cache, table, pos, slots, kernel=kernel)
        outs.append(batch.attend(1, q, k, v, meta, SDPAAttention()))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def fp32_model():
    return make_model(dtype=torch.float32, init_std=0.2)  # peaked logits: no near-ties in fp32


def _kernel_on():
    if paged_kernel.selected()[0] == "torch":
        pytest.skip(f"paged kernel off: {paged_kernel.selected()[1]}")


def test_eager_decode_with_the_kernel_equals_full_recompute(fp32_model, prompts, monkeypatch):
    _kernel_on()
    calls = []
    real = paged_kernel.paged_decode
    monkeypatch.setattr(paged_kernel, "paged_decode", lambda *a: calls.append(1) or real(*a))
    llm = LLM(fp32_model, block_size=4, max_num_seqs=4, compile=False)
    chosen = prompts[:3] + prompts[9:11] + prompts[-4:]  # across blocks, shared prefixes
    out = llm.generate(chosen, greedy(10))
    assert [o.token_ids for o in out] == [full_recompute_greedy(fp32_model, p, 10) for p in chosen]
    assert calls  # the decode steps went through the kernel


@pytest.mark.slow
def test_compiled_decode_with_the_kernel_equals_full_recompute(fp32_model, prompts):
    _kernel_on()
    torch._dynamo.reset()
    llm = LLM(
        fp32_model, block_size=4, num_blocks=40, max_num_seqs=4, compile={"cpp_wrapper": False}
    )
    decode = llm.engine.runner.decode
    decode.buckets = (4,)
    chosen = prompts[:2] + prompts[9:11] + prompts[-4:]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = llm.generate(chosen, greedy(10))
    assert [o.token_ids for o in out] == [full_recompute_greedy(fp32_model, p, 10) for p in chosen]
    names = {e.key for e in prof.key_averages()}
    assert any(n.startswith("lmstack_attn::paged_decode_") for n in names), (
        "kernel not in the graph"
    )
    assert decode.graphs >= 1 and all(decode.regional._direct.values())


@pytest.mark.parametrize("kv_dtype", [torch.float32, "int8"], ids=str)
def test_mixed_step_decode_rows_through_the_kernel_equal_full_recompute(
    fp32_model, prompts, monkeypatch, kv_dtype
):
    """Every step through the packed batch (no decode step): the runs of decode rows beside a prefill chunk
    read the pool in place with the kernel (``SelectivePagedBatch``), and greedy output still equals the
    full recompute; the gather + SDPA path (kernel off) gives the same tokens."""
    _kernel_on()
    calls = []
    real = paged_kernel.paged_decode
    monkeypatch.setattr(
        paged_kernel, "paged_decode", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    chosen = prompts[:3] + prompts[9:11] + prompts[-3:]
    want = [full_recompute_greedy(fp32_model, p, 10) for p in chosen]
    outs = []
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(paged_kernel, "usable", lambda q, k: False)
        llm = LLM(
            fp32_model,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=12,  # prompts take several chunks while others decode
            compile=False,
            kv_dtype=kv_dtype,
        )
        llm.engine.runner.decode = None  # every step is a packed batch
        outs.append([o.token_ids for o in llm.generate(chosen, greedy(10))])
    if kv_dtype == torch.float32:
        assert outs[0] == want
    assert outs[0] == outs[1]
    assert calls and max(calls) > 1  # runs of several decode rows went through the kernel
