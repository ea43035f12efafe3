"""The cache contract (model.cache): every cache declares its abilities, each declared ability's methods exist,
callers check abilities (not attributes), and rollback through a declared ROLLBACK cache equals recompute."""

import pytest
import torch

from lmstack.inference.decode_step import DecodeBatch
from lmstack.inference.kv_cache import (
    KVCache,
    LatentKVCache,
    MixerCache,
    QuantizedKVCache,
    StaticKVCache,
)
from lmstack.inference.paged import PackedPagedBatch, PagedKVCache, SelectivePagedBatch
from lmstack.inference.state_pool import RecurrentBatch
from lmstack.model.cache import METHODS, Ability, Cache, has, require
from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer

A = Ability
# written out by hand from what each cache does (not read from the classes)
EXPECTED = {
    KVCache: {A.ROLLBACK},
    StaticKVCache: {A.STATIC, A.ROLLBACK},
    QuantizedKVCache: {A.QUANTISED},
    LatentKVCache: {A.LATENT, A.ROLLBACK},
    MixerCache: {A.RECURRENT_STATE, A.LAYER_TENSORS},
}
PROMISED = {  # ability -> methods, by hand
    A.ROLLBACK: {"truncate"},
    A.RECURRENT_STATE: {"get_state", "set_state"},
    A.RECURRENT_BATCH: {"recurrent"},
    A.LAYER_TENSORS: {"update", "extra"},
}


def cfg(**kw):
    return ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=32,
        **kw,
    )


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_each_cache_declares_its_abilities_and_has_their_methods(cls):
    assert cls.abilities == EXPECTED[cls]
    assert callable(cls.attend)
    for ability in cls.abilities:
        for name in PROMISED.get(ability, ()):
            assert hasattr(cls, name) or name in vars(MixerCache()), (cls.__name__, name)
    assert {a: set(m) for a, m in METHODS.items() if m} == PROMISED


def test_paged_batches_declare_the_pool():
    plain = PagedKVCache(cfg(), 8, 4, torch.float32, enable_prefix_caching=False)
    int8 = PagedKVCache(cfg(), 8, 4, "int8")
    assert plain.abilities == {A.PAGED}
    assert int8.abilities == {A.PAGED, A.PREFIX_SHARING, A.QUANTISED}
    int8.blocks.allocate("a", [1, 2, 3])
    int8.blocks.reserve("a", 3)
    for selective in (True, False):
        batch, _, _ = int8.packed_batch([("a", 0, 3)], selective=selective)
        assert type(batch) is (SelectivePagedBatch if selective else PackedPagedBatch)
        assert batch.abilities == {A.PAGED, A.PACKED, A.PREFIX_SHARING, A.QUANTISED}
        assert isinstance(batch, Cache)
        wrapped = RecurrentBatch(batch, _Slots(), [("a", 0, 3)])
        assert wrapped.abilities == batch.abilities | {A.RECURRENT_BATCH}
    table = torch.zeros(1, 1, dtype=torch.long)
    assert DecodeBatch(int8, table, torch.zeros(1, dtype=torch.long)).abilities == int8.abilities


class _Slots:  # what RecurrentBatch reads of a StatePool
    slot_of = {"a": 0}


def test_has_and_require():
    c = KVCache(cfg(), 1, 8)
    assert has(c, A.ROLLBACK) and not has(c, A.RECURRENT_STATE) and not has(None, A.ROLLBACK)
    require(c, A.ROLLBACK, "speculation")
    with pytest.raises(TypeError, match=r"speculation needs a cache with RECURRENT_STATE.*KVCache"):
        require(c, A.RECURRENT_STATE, "speculation")


def test_a_cache_without_the_ability_is_refused_by_name():
    """An MLA model with a cache that is not LATENT; a hybrid's recurrent layer with a K/V-only cache."""
    mla = Transformer(
        cfg(head_dim=12, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)
    )
    with pytest.raises(ValueError, match="LATENT"):
        mla(
            torch.zeros(1, 2, dtype=torch.long), torch.arange(2), kv_cache=KVCache(mla.config, 1, 8)
        )
    hybrid = Transformer(cfg(layer_types=["gated_deltanet", "attention"]))
    with pytest.raises(TypeError, match=r"layer 0 \(gated_deltanet\).*RECURRENT_STATE"):
        hybrid(
            torch.zeros(1, 2, dtype=torch.long),
            torch.arange(2),
            kv_cache=KVCache(hybrid.config, 1, 8),
        )


def test_rollback_then_decode_equals_recompute():
    """Through every ROLLBACK cache of the contiguous kind: feed 6 tokens, truncate to 4, feed 2 others; the
    last logits equal one full forward over the kept 4 + the 2 new tokens (fp64)."""
    torch.manual_seed(0)
    model = Transformer(cfg(), seed=0).double().eval()
    ids = torch.randint(0, 64, (1, 8))
    ref = model(torch.cat([ids[:, :4], ids[:, 6:8]], dim=1))[0, -1]
    for cache in (
        KVCache(model.config, 1, 16, dtype=torch.float64),
        StaticKVCache(model.config, 1, 16, dtype=torch.float64),
    ):
        assert has(cache, A.ROLLBACK)
        with torch.no_grad():
            model(ids[:, :6], torch.arange(6), kv_cache=cache)
            cache.truncate(4)
            out = model(ids[:, 6:8], torch.arange(4, 6), kv_cache=cache)[0, -1]
        torch.testing.assert_close(out, ref.detach())
