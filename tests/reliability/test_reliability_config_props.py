"""Config loaders on arbitrary JSON values (hypothesis, derandomized): ModelConfig from dicts and files,
HF config.json, GGUF metadata. Each either builds a valid config or raises ConfigError — never a
TypeError/AttributeError/KeyError/ZeroDivisionError/MemoryError from deep inside — and fields are
never coerced: "false" is not a boolean, "64" and 64.9 are not integers."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmstack.model.config import MAX_SEQ_LEN, ConfigError, ModelConfig
from lmstack.model.gguf import config_from_gguf
from lmstack.model.hf import WeightsError, config_from_hf
from lmstack.model.io import load_model
from lmstack.utils import check_bool, check_float, check_int

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["false", "no", "true", "64", "linear", "llama", "silu", "default", ""]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
sizes = (
    st.integers(min_value=-2, max_value=2**70)
    | st.floats()
    | st.sampled_from([64.0, 64.9, 1e12, 2**32])
)

BASE = {
    "vocab_size": 96,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "d_ff": 128,
    "max_seq_len": 128,
    "rope_theta": 10000.0,
    "norm_eps": 1e-5,
    "tie_embeddings": False,
    "qkv_bias": False,
    "qk_norm": False,
    "parallel_block": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
HF_BASE = {
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
GGUF_BASE = {
    "general.architecture": "llama",
    "llama.vocab_size": 96,
    "llama.embedding_length": 64,
    "llama.block_count": 2,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.feed_forward_length": 128,
    "llama.context_length": 128,
    "llama.rope.freq_base": 10000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
}


def assert_valid(c: ModelConfig) -> None:
    """A config that was accepted holds values of the declared types and sizes."""
    for f in (
        "vocab_size",
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "d_ff",
        "max_seq_len",
        "head_dim",
    ):
        v = getattr(c, f)
        assert type(v) is int and v >= 1, (f, v)
    assert c.max_seq_len <= MAX_SEQ_LEN
    for f in ("tie_embeddings", "qkv_bias", "qk_norm", "parallel_block"):
        assert type(getattr(c, f)) is bool, f
    for f in ("rope_theta", "norm_eps", "init_std"):
        assert (
            type(getattr(c, f)) is float and math.isfinite(getattr(c, f)) and getattr(c, f) > 0
        ), f
    for f in ("bos_token_id", "eos_token_id"):
        assert getattr(c, f) is None or 0 <= getattr(c, f) < c.vocab_size


def only_config_errors(build) -> None:
    try:
        config = build()
    except ConfigError:
        return
    assert_valid(config)


# ---- properties ------------------------------------------------------------------------------------
@SETTINGS
@given(json_values)
def test_model_config_from_any_json_value(value):
    only_config_errors(lambda: ModelConfig.from_dict(value))


@SETTINGS
@given(
    st.sampled_from(
        sorted(BASE)
        + [
            "head_dim",
            "sliding_window",
            "init_std",
            "name",
            "rope_layout",
            "attn_backend",
            "architecture",
        ]
    ),
    json_values | sizes,
)
def test_model_config_with_one_field_replaced(field, value):
    only_config_errors(lambda: ModelConfig.from_dict({**BASE, field: value}))


@SETTINGS
@given(json_values)
def test_hf_config_from_any_json_value(value):
    only_config_errors(lambda: config_from_hf(value, "config.json"))


@SETTINGS
@given(
    st.sampled_from(
        sorted(HF_BASE)
        + [
            "rope_scaling",
            "rope_parameters",
            "head_dim",
            "sliding_window",
            "mlp_bias",
            "attention_bias",
            "_name_or_path",
        ]
    ),
    json_values | sizes,
    st.sampled_from(["llama", "mistral", "qwen2"]),
)
def test_hf_config_with_one_field_replaced(field, value, model_type):
    only_config_errors(
        lambda: config_from_hf({**HF_BASE, "model_type": model_type, field: value}, "config.json")
    )


@SETTINGS
@given(
    st.sampled_from(
        sorted(GGUF_BASE)
        + [
            "llama.rope.dimension_count",
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.tokens",
            "general.name",
        ]
    ),
    json_values | sizes,
)
def test_gguf_metadata_with_one_field_replaced(field, value):
    meta = {**GGUF_BASE, field: value}
    if field == "llama.vocab_size":
        del meta[field]
        meta["tokenizer.ggml.tokens"] = value
    only_config_errors(lambda: config_from_gguf(meta, "m.gguf"))


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.one_of(
        json_values,
        st.dictionaries(st.sampled_from(sorted(HF_BASE)), json_values | sizes).map(
            lambda d: {**HF_BASE, **d}
        ),
    ),
    st.booleans(),
)
def test_config_files_on_disk(tmp_path, value, as_text_garbage):
    """ModelConfig.load and load_model on a checkpoint folder whose config.json holds anything."""
    path = tmp_path / "config.json"
    if as_text_garbage:
        path.write_bytes(json.dumps(value)[:7].encode() + b"\xff\xfe")
    else:
        path.write_text(json.dumps(value))
    only_config_errors(lambda: ModelConfig.load(path))
    with pytest.raises(
        (ConfigError, WeightsError)
    ):  # a config error, or (valid config) no weights file
        load_model(tmp_path)


# ---- the cases the issue names ------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["tie_embeddings", "qk_norm", "qkv_bias", "parallel_block"])
@pytest.mark.parametrize("value", ["false", "no", "true", 0, 1, None, []])
def test_boolean_fields_take_only_booleans(field, value):
    with pytest.raises(
        ConfigError,
        match=rf"^{field}={value!r} must be true or false".replace("[", r"\[").replace("]", r"\]"),
    ):
        ModelConfig.from_dict({**BASE, field: value})


@pytest.mark.parametrize(
    "field", ["vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"]
)
@pytest.mark.parametrize("value", ["64", 64.9, None, True, [64]])
def test_integer_fields_are_not_parsed_or_truncated(field, value):
    with pytest.raises(ConfigError, match=rf"^{field}=.* must be a positive integer \(got "):
        ModelConfig.from_dict({**BASE, field: value})


def test_integral_floats_are_accepted_as_integers():
    c = ModelConfig.from_dict({**BASE, "d_model": 64.0, "rope_theta": 500000})
    assert type(c.d_model) is int and c.d_model == 64 and type(c.rope_theta) is float


@pytest.mark.parametrize("value", ["1e4", None, float("nan"), float("inf"), True])
def test_float_fields_take_only_finite_numbers(value):
    with pytest.raises(ConfigError, match=r"^rope_theta=.* must be a (finite )?number"):
        ModelConfig.from_dict({**BASE, "rope_theta": value})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rope_scaling", "linear", "rope_scaling='linear' must be an object (or null), got str"),
        ("rope_parameters", [1], "rope_parameters=[1] must be an object (or null), got list"),
        ("hidden_size", None, "hidden_size=None must be a positive integer (got NoneType)"),
        ("hidden_size", 64.9, "hidden_size=64.9 must be a positive integer (got float)"),
        ("num_attention_heads", 0, "num_attention_heads=0 must be a positive integer"),
        (
            "max_position_embeddings",
            1e12,
            f"max_position_embeddings=1000000000000 is too large; expected at most {MAX_SEQ_LEN}",
        ),
        ("tie_word_embeddings", "false", "tie_word_embeddings='false' must be true or false"),
        ("eos_token_id", "2", "eos_token_id='2' must be a non-negative integer (got str)"),
        ("eos_token_id", 96, "eos_token_id=96 is not a token id of vocab_size=96"),
    ],
)
def test_hf_config_fields_are_named(tmp_path, field, value, message):
    (tmp_path / "config.json").write_text(json.dumps({**HF_BASE, field: value}))
    with pytest.raises(
        ConfigError,
        match="config.json: "
        + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"),
    ):
        load_model(tmp_path)


@pytest.mark.parametrize("value", [5, [1, 2], "llama", None])
def test_config_json_that_is_not_an_object(tmp_path, value):
    (tmp_path / "config.json").write_text(json.dumps(value))
    with pytest.raises(
        ConfigError, match=rf"config.json: expected a JSON object, got {type(value).__name__}"
    ):
        load_model(tmp_path)


def test_huge_context_is_refused_before_any_rope_table_is_built():
    with pytest.raises(
        ConfigError, match=rf"max_seq_len=4294967296 is too large; expected at most {MAX_SEQ_LEN}"
    ):
        ModelConfig.from_dict({**BASE, "max_seq_len": 2**32})


def test_strict_checkers_raise_the_callers_error_type():
    class MyError(ValueError):
        pass

    assert check_bool("x", True, MyError) is True and check_int("n", 3.0, MyError) == 3
    assert check_float("f", 2, MyError) == 2.0
    for bad in (
        lambda: check_bool("x", "no", MyError),
        lambda: check_int("n", "3", MyError),
        lambda: check_int("n", 0, MyError, minimum=1),
        lambda: check_int("n", 9, MyError, maximum=8),
        lambda: check_float("f", float("nan"), MyError),
    ):
        with pytest.raises(MyError):
            bad()
