"""The cache contract: what every cache handed to the model as ``kv_cache=`` is, and what it may declare.

Book of LLMs §2.4 (the KV cache), CS336 notes "注意力机制" (recurrent mixers keep an O(1) state instead of K/V),
"动态负载" (vLLM PagedAttention: blocks, prefix sharing), "低精度计算" (1-byte KV). The model calls one
method of a cache, ``attend(layer_idx, q, k, v, meta, impl)`` (``model.seam``); everything else a layer or a
caller may ask of it is an **ability** the cache declares in ``abilities`` (a frozenset of ``Ability``), and a
caller checks ``has(cache, Ability.X)`` / ``require(cache, Ability.X, who)`` instead of probing attributes.
Each ability names the methods it promises (``METHODS``); ``tests/model/test_model_cache.py`` checks every
cache class against it.

The caches (``docs/architecture.md``, "The cache contract"): ``inference.kv_cache`` holds the per-sequence ones
(``KVCache``, ``StaticKVCache``, ``QuantizedKVCache``, ``LatentKVCache``, ``MixerCache``), ``inference.paged``
the engine's block pool (``PagedKVCache``) and the batch objects its forwards attend through
(``PackedPagedBatch``, ``SelectivePagedBatch``), ``inference.decode_step`` the decode-only ``DecodeBatch``,
``inference.state_pool`` the recurrent-state pool and its ``RecurrentBatch``. All 1-byte K/V goes through one
codec, ``quant.kv_codec``.

This module imports only torch and ``model.seam``; ``StoreThenAttend`` gives ``attend`` to a cache that can
``update(layer_idx, k, v, positions)``.
"""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

from torch import Tensor

from lmstack.model.seam import AttentionImpl, AttentionMetadata


class Ability(enum.Enum):
    """What a cache can do besides ``attend``; the value says what it promises."""

    ROLLBACK = "truncate(length): forget every position >= length (speculation's rejected drafts)"
    LATENT = "stores MLA's latent [c ; k_R] per token and takes v=None (model.mla, absorbed form)"
    RECURRENT_STATE = "get_state(layer) / set_state(layer, state): one recurrent state per row"
    RECURRENT_BATCH = (
        "recurrent(layer, x, mix): runs a recurrent layer over several packed sequences"
    )
    LAYER_TENSORS = (
        "update(layer, k, v, positions) -> every key of the layer, and extra[(layer, name)]: tensors a "
        "layer keeps beside its K/V (DSA's indexer keys)"
    )
    PACKED = "document_ids may be passed: the cache knows which sequence each key belongs to"
    PAGED = "K/V live in fixed-size blocks of a shared pool, reached through block tables"
    PREFIX_SHARING = "blocks of a common prompt prefix are shared between sequences (copy-on-write)"
    QUANTISED = (
        "K/V are held as 1-byte codes with scales (quant.kv_codec) and dequantised to attend"
    )
    STATIC = (
        "fixed shapes: every call returns all max_seq_len slots (a compiled step never reshapes)"
    )


#: the methods / attributes each ability promises (beside ``attend`` and ``abilities``)
METHODS: dict[Ability, tuple[str, ...]] = {
    Ability.ROLLBACK: ("truncate",),
    Ability.LATENT: (),
    Ability.RECURRENT_STATE: ("get_state", "set_state"),
    Ability.RECURRENT_BATCH: ("recurrent",),
    Ability.LAYER_TENSORS: ("update", "extra"),
    Ability.PACKED: (),
    Ability.PAGED: (),
    Ability.PREFIX_SHARING: (),
    Ability.QUANTISED: (),
    Ability.STATIC: (),
}


@runtime_checkable
class Cache(Protocol):
    """Any object passed as ``kv_cache=``: stores this forward's k, v (B, K, T, H) for ``layer_idx``, then calls
    ``impl`` on the keys it holds with a record describing them (``AttentionMetadata.for_keys``) ->
    (B, N, T, H); ``abilities`` declares what else it does."""

    abilities: frozenset[Ability]

    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor | None,
        meta: AttentionMetadata,
        impl: AttentionImpl,
    ) -> Tensor: ...


def has(cache: object, ability: Ability) -> bool:
    """Whether ``cache`` declares ``ability`` (None, or an object that declares nothing: False)."""
    return ability in getattr(cache, "abilities", ())


def require(cache: object, ability: Ability, who: str, hint: str = "") -> None:
    """Raise TypeError naming ``who`` needs ``ability`` of ``cache`` when the cache does not declare it."""
    if not has(cache, ability):
        raise TypeError(
            f"{who} needs a cache with {ability.name} ({ability.value}); {type(cache).__name__} "
            f"declares {sorted(a.name for a in getattr(cache, 'abilities', ())) or 'none'}"
            + (f"; {hint}" if hint else "")
        )


class StoreThenAttend:
    """``Cache.attend`` for a cache whose ``update(layer_idx, k, v, positions)`` stores k, v (B, K, T, H) and
    returns every key/value of the layer (B, K, S, H) x2 with their positions (B, S). One sequence per row:
    ``document_ids`` (packed sequences) are refused unless the cache declares ``Ability.PACKED``."""

    abilities: frozenset[Ability] = frozenset()

    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        meta: AttentionMetadata,
        impl: AttentionImpl,
    ) -> Tensor:
        if meta.document_ids is not None and not has(self, Ability.PACKED):
            raise ValueError(
                f"document_ids with a {type(self).__name__}: this cache holds one sequence per row; "
                "packed sequences need a cache that knows its keys' sequence ids (the paged engine's)"
            )
        k_all, v_all, key_positions = self.update(layer_idx, k, v, meta.positions)
        return impl(q, k_all, v_all, meta.for_keys(key_positions))

    def update(
        self, layer_idx: int, k: Tensor, v: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError
