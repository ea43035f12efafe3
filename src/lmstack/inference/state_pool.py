"""The recurrent-state pool: per-sequence states of a hybrid model's recurrent layers, next to the paged KV blocks.

CS336 notes "注意力机制" (linear attention, Mamba-2 and Gated DeltaNet keep an O(1) state per sequence — the
matrix S plus the short convolution's last K_c − 1 inputs — instead of K/V that grow with S) and "动态负载"
(a sequence enters on admission and leaves on finish, abort or preemption). The pool holds, for every
recurrent layer, tensors (num_slots, ...) shaped like the mixer's own state; a sequence gets one slot when the
scheduler admits it and gives it back when it finishes, is aborted or is preempted (preemption is by
recomputation: the state is dropped and rebuilt from the tokens). When no slot is free, requests wait.

A forward's batch object (``PagedKVCache.packed_batch``) is wrapped by ``StatePool.batch``: the recurrent
layers call ``recurrent(layer_idx, x, mix)`` on it (``model.recurrent.RecurrentMixer.forward``), which runs
the run of single-token rows as one batched recurrent step on their gathered states (R, ...), each longer row
(a prefill chunk) on its own from its stored state (None at position 0: the chunked form from zeros), and
*stages* the new states. They enter the slots only when the scheduler commits that sequence's tokens
(``commit``), so a forward that raises and is rerun never advances a state twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from lmstack.model.cache import Ability
from lmstack.model.recurrent import RecurrentMixer

if TYPE_CHECKING:
    from lmstack.model.transformer import Transformer


class NoFreeSlots(RuntimeError):
    """Every state slot is taken (the scheduler admits only when one is free)."""


def recurrent_layers(model: nn.Module) -> dict[int, RecurrentMixer]:
    """layer index -> the recurrent token mixer of each layer that has one (linear attention, Mamba-2, Gated DeltaNet)."""
    out = {}
    for i, block in enumerate(getattr(model, "blocks", [])):
        mixer = getattr(block, "attn", None)
        if isinstance(mixer, RecurrentMixer):
            out[getattr(mixer, "layer_idx", i)] = mixer
    return out


class StatePool:
    """``num_slots`` slots of every recurrent layer's state (conv inputs in the model dtype, S in fp32 — each
    tensor as the mixer returns it); ``slot_of[seq_id]`` is a running sequence's slot."""

    def __init__(self, model: Transformer, num_slots: int):
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(
                f"num_state_slots={num_slots!r} must be an integer >= 1 (the sequences that can hold "
                "a recurrent state at once)"
            )
        self.num_slots = num_slots
        self.layers = recurrent_layers(model)
        p = next(model.parameters())
        x0 = torch.zeros(1, 1, model.config.d_model, dtype=p.dtype, device=p.device)
        self.states: dict[
            int, tuple[Tensor, ...]
        ] = {}  # layer -> per state tensor (num_slots, ...)
        with torch.no_grad():
            for i, mixer in self.layers.items():
                _, state = mixer.mix(
                    x0, None
                )  # one token from zeros: the state's shapes and dtypes
                self.states[i] = tuple(
                    torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype, device=t.device)
                    for t in state
                )
        self.free_slots: deque[int] = deque(range(num_slots))
        self.slot_of: dict[Hashable, int] = {}
        self.pending: dict[
            Hashable, dict[int, tuple[Tensor, ...]]
        ] = {}  # staged by the last forward

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (every slot of every recurrent layer)."""
        return sum(t.numel() * t.element_size() for ts in self.states.values() for t in ts)

    @property
    def bytes_per_slot(self) -> int:
        """State bytes of one sequence: Σ over recurrent layers of its state + conv inputs."""
        return self.nbytes // self.num_slots

    def allocate(self, seq_id: Hashable) -> int:
        """Give ``seq_id`` a slot, zeroed (a fresh state)."""
        if seq_id in self.slot_of:
            raise ValueError(f"sequence {seq_id!r} already holds state slot {self.slot_of[seq_id]}")
        if not self.free_slots:
            raise NoFreeSlots(f"all {self.num_slots} state slots are in use")
        slot = self.free_slots.popleft()
        for ts in self.states.values():
            for t in ts:
                t[slot].zero_()
        self.slot_of[seq_id] = slot
        return slot

    def free(self, seq_id: Hashable) -> None:
        """Give the slot back (finish, abort, error, preemption); a sequence without one is ignored."""
        self.pending.pop(seq_id, None)
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def commit(self, seq_id: Hashable) -> None:
        """Write the states the last forward staged for ``seq_id`` into its slot (its tokens are committed)."""
        staged = self.pending.pop(seq_id, None)
        if staged is None:
            return
        slot = self.slot_of[seq_id]
        for layer, new in staged.items():
            for t, s in zip(self.states[layer], new):
                t[slot].copy_(s[0])

    def batch(self, inner, rows: Sequence[tuple[Hashable, int, int]]) -> RecurrentBatch:
        """Wrap one forward's KV batch object for rows (seq_id, start, n) in the order the tokens are packed."""
        self.pending = {}
        return RecurrentBatch(inner, self, rows)


class RecurrentBatch:
    """The seam object of one engine forward for a model with recurrent layers: attention layers go to the
    KV batch (``attend``), recurrent layers to ``recurrent``."""

    def __init__(self, inner, pool: StatePool, rows: Sequence[tuple[Hashable, int, int]]):
        self.inner, self.pool = inner, pool
        # groups: (t0, t1, row indices); consecutive single-token rows form one batched group
        self.groups: list[tuple[int, int, list[int]]] = []
        t0, r = 0, 0
        while r < len(rows):
            r1 = r + 1
            if rows[r][2] == 1:
                while r1 < len(rows) and rows[r1][2] == 1:
                    r1 += 1
            t1 = t0 + sum(n for _, _, n in rows[r:r1])
            self.groups.append((t0, t1, list(range(r, r1))))
            t0, r = t1, r1
        self.rows = rows
        self.slots = [pool.slot_of[sid] for sid, _, _ in rows]

    @property
    def abilities(self) -> frozenset[Ability]:
        """The KV batch's, and ``RECURRENT_BATCH``: recurrent layers call ``recurrent`` (``model.cache``)."""
        return self.inner.abilities | {Ability.RECURRENT_BATCH}

    def attend(self, layer_idx, q, k, v, meta, impl):
        return self.inner.attend(layer_idx, q, k, v, meta, impl)

    def recurrent(self, layer_idx: int, x: Tensor, mix) -> Tensor:
        """x (1, T, D) of the packed rows -> (1, T, D); ``mix(x, state) -> (y, new state)`` is the layer's."""
        stored = self.pool.states[layer_idx]
        outs = []
        for t0, t1, idx in self.groups:
            if (
                len(idx) > 1 or self.rows[idx[0]][2] == 1
            ):  # single-token rows: one batched recurrent step
                slots = torch.tensor([self.slots[i] for i in idx], device=x.device)
                state: tuple[Tensor, ...] | None = tuple(
                    t.index_select(0, slots) for t in stored
                )  # (R, ...)
                y, new = mix(x[0, t0:t1, None], state)  # (R, 1, D)
                outs.append(y[:, 0][None])
            else:  # one prefill chunk: from its stored state, or from zeros at the prompt's start
                i = idx[0]
                slot = self.slots[i]
                state = None if self.rows[i][1] == 0 else tuple(t[slot : slot + 1] for t in stored)
                y, new = mix(x[:, t0:t1], state)  # (1, n, D)
                outs.append(y)
            for j, i in enumerate(idx):
                self.pool.pending.setdefault(self.rows[i][0], {})[layer_idx] = tuple(
                    s[j : j + 1] for s in new
                )
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
