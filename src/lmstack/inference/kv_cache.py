"""The per-sequence caches, one sequence per batch row (Book of LLMs §2.4 “the KV cache” KV cache, §1.7 its bytes; ``model.cache``
is the contract every cache keeps and the abilities it declares):

- ``KVCache``: contiguous, preallocated K/V, two (L, B, K, S_max, H) tensors: KV bytes =
  2 · B · S_max · K · H · L · bytes per element (Book of LLMs §1.7 “inference memory”). ``ROLLBACK``.
- ``StaticKVCache``: fixed shapes for a compiled decode step (``inference.static``). ``STATIC``, ``ROLLBACK``.
- ``QuantizedKVCache``: int8 / fp8 e4m3 blocks through the KV codec (``quant.kv_codec``; CS336 notes
  "性能指标分析": P = 1 byte halves a bf16 cache). ``QUANTISED``.
- ``LatentKVCache``: MLA's latent [c ; k_R] per token (``model.mla``). ``LATENT``, ``ROLLBACK``.
- ``MixerCache``: a hybrid's K/V (windowed layers keep their last W − 1) and recurrent states, and per-layer
  extras (DSA's indexer keys). ``RECURRENT_STATE``, ``LAYER_TENSORS``.

The engine's block pool and its batch objects are ``inference.paged`` / ``inference.state_pool``. Each plugs
into the attention seam (``lmstack.model.seam``): ``attend`` stores K/V (most through ``update``,
``model.cache.StoreThenAttend``), then attends over every stored key.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmstack.model.cache import Ability, StoreThenAttend
from lmstack.model.config import ModelConfig
from lmstack.model.seam import AttentionImpl, AttentionMetadata
from lmstack.quant.kv_codec import check_format, decode, quantize_blocks


class KVCache(StoreThenAttend):
    """The contiguous cache: K and V of every layer in two (L, B, K, S_max, H) tensors, allocated once; each row
    writes its tokens at their own positions (left-padded or ragged batches work)."""

    abilities = frozenset({Ability.ROLLBACK})

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if max_seq_len > config.max_seq_len:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's max_seq_len={config.max_seq_len}"
            )
        assert (
            config.n_kv_heads is not None and config.head_dim is not None
        )  # resolved by ModelConfig.__post_init__
        shape = (
            config.n_layers,
            batch_size,
            config.n_kv_heads,
            max_seq_len,
            config.head_dim,
        )  # (L, B, K, S, H)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.full(
            (batch_size, max_seq_len), -1, dtype=torch.long, device=device
        )  # (B, S)
        self.length = 0  # slots 0 .. length-1 may hold tokens

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def truncate(self, length: int) -> None:
        """Forget every token at position >= ``length`` (speculative decoding rolls back rejected drafts)."""
        if length < 0:
            raise ValueError(f"length={length} must be >= 0")
        self.positions[:, length:] = -1
        self.length = min(self.length, length)

    def update(
        self, layer_idx: int, k: Tensor, v: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Store k, v (B, K, T, H) at ``positions`` (B, T) or (T,); return this layer's (B, K, S, H) x2 and (B, S)."""
        B, K, T, H = k.shape
        pos = positions.expand(B, T) if positions.dim() == 1 else positions  # (B, T)
        if int(pos.max()) >= self.k.shape[3]:
            raise ValueError(
                f"position {int(pos.max())} is past the cache's max_seq_len={self.k.shape[3]}"
            )
        index = pos[:, None, :, None].expand(B, K, T, H)
        self.k[layer_idx].scatter_(2, index, k.to(self.k.dtype))
        self.v[layer_idx].scatter_(2, index, v.to(self.v.dtype))
        if layer_idx == 0:
            self.positions.scatter_(1, pos, pos)
            self.length = max(self.length, int(pos.max()) + 1)
        S = self.length
        return self.k[layer_idx, :, :, :S], self.v[layer_idx, :, :, :S], self.positions[:, :S]


class StaticKVCache(StoreThenAttend):
    """Keys/values, one (B, K, S_max, H) tensor per layer, and slot positions (B, S_max); slot i
    holds position i.

    ``update`` returns all S_max slots every time (fixed shapes); slots not yet written hold
    position −1, which ``attention_mask`` treats as empty. One tensor per layer (not one
    (L, ...) tensor) so that a compiled step writes each layer's slot in place instead of
    copying a view's whole base. An eager forward that knows how many slots are live (a prefill
    of n tokens from position 0: slots 0 .. n−1) sets ``live = n`` and gets views of the first n
    slots only, so its attention does not read (and mask) the S_max − n empty ones: a 88-token
    prompt's attention over a 665-slot cache was 45 ms of a 180 ms prefill (SmolLM2-135M, one thread).

    ``block_size=bs`` lays the cache out as a paged pool instead, for the regionally compiled decode step
    (``inference.regional``): K and V each one (L, B, S', K, H) tensor, S' = S_max rounded up to a multiple
    of bs, whose layer l is the pool ``pool(l)`` (B·S'/bs, bs, K, H) — row b's slots are blocks
    b·S'/bs .. (b+1)·S'/bs − 1 (``table``) — so the paged kernel reads it in place, slots 0 .. p only;
    ``update`` returns (B, K, S, H) views of it, and ``store`` writes one decode step's k, v of every
    layer in one ``index_copy_``.
    """

    abilities = frozenset({Ability.STATIC, Ability.ROLLBACK})

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        block_size: int | None = None,
    ):
        if max_seq_len > config.max_seq_len:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's max_seq_len={config.max_seq_len}"
            )
        assert (
            config.n_kv_heads is not None and config.head_dim is not None
        )  # resolved by ModelConfig.__post_init__
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.block_size = block_size
        L, B, K, H = config.n_layers, batch_size, config.n_kv_heads, config.head_dim
        if block_size is None:
            shape = (B, K, max_seq_len, H)  # (B, K, S, H)
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(L)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(L)]
        else:
            padded = -(-max_seq_len // block_size) * block_size  # S'
            self.k_layers = torch.zeros(L, B, padded, K, H, dtype=dtype, device=device)
            self.v_layers = torch.zeros(L, B, padded, K, H, dtype=dtype, device=device)
            self.k, self.v = (
                list(self.k_layers.unbind(0)),
                list(self.v_layers.unbind(0)),
            )  # (B, S', K, H)
            blocks = padded // block_size
            self.table = torch.arange(B * blocks, device=device).view(B, blocks)  # (B, S'/bs)
        self.positions = torch.full(
            (batch_size, max_seq_len), -1, dtype=torch.long, device=device
        )  # (B, S)
        self.max_seq_len = max_seq_len
        self.live: int | None = (
            None  # slots 0 .. live−1 hold every position fed so far (eager forwards)
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset(self) -> None:
        self.positions.fill_(-1)

    def truncate(self, length: int) -> None:
        """Forget every slot at position >= ``length`` (speculation rolls back rejected drafts)."""
        self.positions[:, length:] = -1

    def update(
        self, layer_idx: int, k: Tensor, v: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Store k, v (B, K, T, H) at ``positions`` (T,) (the same for every row); return
        this layer's full (B, K, S_max, H) x2 and the slot positions (B, S_max), or with ``live = n``
        their first n slots (B, K, n, H) x2, (B, n)."""
        if positions.dim() != 1:
            raise ValueError(
                f"StaticKVCache takes positions of shape (T,), got {tuple(positions.shape)}"
            )
        if self.block_size is None:
            self.k[layer_idx].index_copy_(2, positions, k.to(self.k[layer_idx].dtype))
            self.v[layer_idx].index_copy_(2, positions, v.to(self.v[layer_idx].dtype))
            keys, values = self.k[layer_idx], self.v[layer_idx]  # (B, K, S, H)
        else:  # the pool layout (B, S', K, H): written along S', returned as (B, K, S, H) views
            dt = self.k[layer_idx].dtype
            self.k[layer_idx].index_copy_(1, positions, k.transpose(1, 2).to(dt))
            self.v[layer_idx].index_copy_(1, positions, v.transpose(1, 2).to(dt))
            S = self.max_seq_len
            keys = self.k[layer_idx][:, :S].transpose(1, 2)
            values = self.v[layer_idx][:, :S].transpose(1, 2)
        if layer_idx == 0:
            self.positions.index_copy_(1, positions, positions.expand(self.positions.shape[0], -1))
        n = self.live
        if n is None:
            return keys, values, self.positions
        return keys[:, :, :n], values[:, :, :n], self.positions[:, :n]

    def pool(self, layer_idx: int) -> tuple[Tensor, Tensor]:
        """With ``block_size``: layer l's K and V as paged pools (B·S'/bs, bs, K, H), views of the cache."""
        if self.block_size is None:
            raise ValueError("StaticKVCache.pool needs the pool layout (block_size=...)")
        bs, (K, H) = self.block_size, self.k[layer_idx].shape[2:]
        return self.k[layer_idx].view(-1, bs, K, H), self.v[layer_idx].view(-1, bs, K, H)

    def store(self, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """With ``block_size``: one decode step's k, v (L, B, K, H) of every layer at ``positions`` (1,),
        the same for every row, in one ``index_copy_`` each; the slots' positions too."""
        if self.block_size is None:
            raise ValueError("StaticKVCache.store needs the pool layout (block_size=...)")
        self.k_layers.index_copy_(2, positions, k[:, :, None].to(self.k_layers.dtype))
        self.v_layers.index_copy_(2, positions, v[:, :, None].to(self.v_layers.dtype))
        self.positions.index_copy_(1, positions, positions.expand(self.positions.shape[0], -1))


class QuantizedKVCache(StoreThenAttend):
    """K/V for L layers, B rows, up to ``max_seq_len`` positions, in ``fmt`` blocks of ``block_size`` positions
    with one scale per (layer, row, KV head, block) through the KV codec (``quant.kv_codec``). A block is
    quantised once, when it is full; the open block stays in the compute dtype, so an append never re-rounds
    stored codes. Tokens must arrive in order (prefill, then decode steps)."""

    abilities = frozenset({Ability.QUANTISED})

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_seq_len: int,
        fmt: str = "int8",
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
    ):
        code_dt, _ = check_format(fmt)
        if max_seq_len % block_size:
            raise ValueError(
                f"max_seq_len={max_seq_len} is not a multiple of block_size={block_size}"
            )
        assert (
            config.n_kv_heads is not None and config.head_dim is not None
        )  # resolved by ModelConfig.__post_init__
        L, B, K, H = config.n_layers, batch_size, config.n_kv_heads, config.head_dim
        nb = max_seq_len // block_size
        self.fmt, self.block_size, self.dtype = fmt, block_size, dtype
        self.codes = torch.zeros(
            2, L, B, K, nb, block_size, H, dtype=code_dt
        )  # (K|V, L, B, K, S/bs, bs, H)
        self.scales = torch.zeros(2, L, B, K, nb, dtype=torch.float32)  # one per block and head
        self.open = torch.zeros(2, L, B, K, block_size, H, dtype=dtype)  # the block being filled
        self.lengths = [0] * L  # positions stored per layer

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.open))

    def update(
        self, layer_idx: int, k: Tensor, v: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Store k, v (B, K, T, H) at positions n .. n+T−1 (n = what the layer holds); return (B, K, S, H) x2, (B, S)."""
        B, K, T, H = k.shape
        n = self.lengths[layer_idx]
        pos = positions if positions.dim() == 1 else positions[0]
        if (
            pos.numel() != T
            or int(pos[0]) != n
            or (T > 1 and not torch.equal(pos, torch.arange(n, n + T)))
        ):
            raise ValueError(
                f"QuantizedKVCache stores tokens in order: expected positions {n}..{n + T - 1}, got "
                f"{pos.tolist()[:4]}{'...' if T > 4 else ''}"
            )
        bs = self.block_size
        if n + T > self.codes.shape[4] * bs:
            raise ValueError(
                f"position {n + T - 1} is past the cache's max_seq_len={self.codes.shape[4] * bs}"
            )
        new = torch.stack([k, v]).to(self.dtype)  # (2, B, K, T, H)
        filled = n % bs
        stream = torch.cat(
            [self.open[:, layer_idx, :, :, :filled], new], dim=3
        )  # (2, B, K, filled + T, H)
        first_block = n // bs
        full = stream.shape[3] // bs
        if full:
            blocks = stream[:, :, :, : full * bs].reshape(2, B, K, full, bs, H)
            codes, s = quantize_blocks(blocks, self.fmt)
            self.codes[:, layer_idx, :, :, first_block : first_block + full] = codes
            self.scales[:, layer_idx, :, :, first_block : first_block + full] = s
        rest = stream.shape[3] - full * bs
        self.open[:, layer_idx, :, :, :rest] = stream[:, :, :, full * bs :]
        self.lengths[layer_idx] = n + T
        S = n + T
        nfull = S // bs
        deq = decode(
            self.codes[:, layer_idx, :, :, :nfull],
            self.scales[:, layer_idx, :, :, :nfull, None, None],
            self.dtype,
        ).reshape(2, B, K, nfull * bs, H)
        kv = torch.cat(
            [deq, self.open[:, layer_idx, :, :, : S - nfull * bs]], dim=3
        )  # (2, B, K, S, H)
        return kv[0], kv[1], torch.arange(S).expand(B, S)


class LatentKVCache:
    """A contiguous MLA cache: per layer (B, S_max, d_c + d_R) — the latent and the RoPE key, nothing else.

    ``attend`` appends the new tokens' [c ; k_R] at their positions and attends with keys [c ; k_R] and
    values c, a view of the same storage. Bytes per token = (d_c + d_R)·L·bytes (``nbytes_per_token``).
    """

    abilities = frozenset({Ability.LATENT, Ability.ROLLBACK})

    def __init__(
        self, config: ModelConfig, batch_size: int, max_len: int, device=None, dtype=torch.float32
    ):
        if not config.is_mla:
            raise ValueError(
                f"LatentKVCache needs an MLA config (kv_lora_rank > 0), got kv_lora_rank="
                f"{config.kv_lora_rank}"
            )
        self.d_c = config.kv_lora_rank
        width = config.kv_lora_rank + config.qk_rope_head_dim
        self.data = [
            torch.zeros(batch_size, max_len, width, device=device, dtype=dtype)
            for _ in range(config.n_layers)
        ]
        self.length = [0] * config.n_layers
        self.max_len = max_len

    @property
    def nbytes_per_token(self) -> int:
        return sum(t.shape[-1] * t.element_size() for t in self.data)

    def truncate(self, length: int) -> None:
        """Forget every token at position >= ``length`` (speculation rolls back rejected drafts)."""
        self.length = [min(n, length) for n in self.length]

    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor | None,
        meta: AttentionMetadata,
        impl: AttentionImpl,
    ) -> Tensor:
        if meta.document_ids is not None:
            raise ValueError("document_ids with a LatentKVCache: it holds one sequence per row")
        T = k.shape[2]
        start = self.length[layer_idx]
        if start + T > self.max_len:
            raise ValueError(f"LatentKVCache: {start} + {T} tokens exceed max_len={self.max_len}")
        buf = self.data[layer_idx]
        buf[:, start : start + T] = k[:, 0].to(buf.dtype)
        self.length[layer_idx] = start + T
        keys = buf[:, None, : start + T]  # (B, 1, S, d_c + d_R)
        key_positions = torch.arange(start + T, device=buf.device)
        return impl(
            q, keys.to(q.dtype), keys[..., : self.d_c].to(q.dtype), meta.for_keys(key_positions)
        )


class MixerCache(StoreThenAttend):
    """One sequence per row: K/V for attention layers (the last W − 1 for windowed ones), recurrent (and conv)
    states for the others. K/V live in buffers that grow by doubling, so a decode step writes one position
    instead of copying the whole cache. ``nbytes()`` reports what it holds (the used positions). Pass it as
    ``kv_cache=``; prefill and decode then continue exactly where the last call stopped."""

    abilities = frozenset({Ability.RECURRENT_STATE, Ability.LAYER_TENSORS})

    def __init__(self) -> None:
        self._kv: dict[int, list] = {}  # layer -> [k (B, K, cap, H), v, positions (B, cap), n used]
        self.states: dict[int, tuple[Tensor, ...]] = {}
        self.extra: dict[tuple[int, str], Tensor] = {}  # e.g. DSA's indexer keys

    @property
    def kv(self) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
        """layer -> (k (B, K, S, H), v, positions (B, S)) of the held positions."""
        return {i: (k[:, :, :n], v[:, :, :n], p[:, :n]) for i, (k, v, p, n) in self._kv.items()}

    def update(
        self, layer_idx: int, k: Tensor, v: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        B, K, T, H = k.shape
        if positions.dim() == 1:
            positions = positions.expand(B, -1)
        entry = self._kv.get(layer_idx)
        n = 0 if entry is None else entry[3]
        if entry is None or n + T > entry[0].shape[2]:
            cap = max(16, n + T, 2 * (0 if entry is None else entry[0].shape[2]))
            kb, vb = k.new_empty(B, K, cap, H), v.new_empty(B, K, cap, v.shape[-1])
            pb = positions.new_full((B, cap), -1)
            if entry is not None:
                kb[:, :, :n], vb[:, :, :n], pb[:, :n] = (
                    entry[0][:, :, :n],
                    entry[1][:, :, :n],
                    entry[2][:, :n],
                )
            entry = self._kv[layer_idx] = [kb, vb, pb, n]
        kb, vb, pb, _ = entry
        kb[:, :, n : n + T], vb[:, :, n : n + T], pb[:, n : n + T] = k, v, positions
        entry[3] = n + T
        return kb[:, :, : n + T], vb[:, :, : n + T], pb[:, : n + T]

    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        meta: AttentionMetadata,
        impl: AttentionImpl,
    ) -> Tensor:
        out = super().attend(layer_idx, q, k, v, meta, impl)
        entry = self._kv[layer_idx]
        keep = None if meta.window is None else max(meta.window - 1, 0)
        if (
            keep is not None and entry[3] > keep
        ):  # later queries never see more than the last W − 1 keys
            kb, vb, pb, n = entry
            kb[:, :, :keep], vb[:, :, :keep], pb[:, :keep] = (
                kb[:, :, n - keep : n].clone(),
                vb[:, :, n - keep : n].clone(),
                pb[:, n - keep : n].clone(),
            )
            entry[3] = keep
        return out

    def get_state(self, layer_idx: int):
        return self.states.get(layer_idx)

    def set_state(self, layer_idx: int, state: tuple[Tensor, ...]) -> None:
        self.states[layer_idx] = state

    def nbytes(self) -> dict[str, int]:
        """Bytes held: K/V (positions excluded), recurrent states, and extra per-layer tensors."""
        kv = sum(
            k.numel() * k.element_size() + v.numel() * v.element_size()
            for k, v, _ in self.kv.values()
        )
        st = sum(t.numel() * t.element_size() for s in self.states.values() for t in s)
        ex = sum(t.numel() * t.element_size() for t in self.extra.values())
        return {"kv": kv, "state": st, "extra": ex}
