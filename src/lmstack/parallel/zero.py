"""ZeRO-1/2 (sharded optimizer states, then gradients) and ZeRO-3 / FSDP (sharded parameters).

Book of LLMs §6.4 “DDP and ZeRO” and CS336 notes "数据并行":

- ZeRO-1: each of M devices keeps the optimizer states of 1/M of the parameters. After
  backward the gradients are reduce-scattered (each rank gets the summed gradient of its shard),
  each rank updates its shard, and the updated parameters are all-gathered. Reduce-scatter +
  all-gather moves exactly the bytes of one all-reduce: "free memory wins".
- ZeRO-2: as ZeRO-1, but each parameter's gradient is reduce-scattered as soon as it is ready
  (a gradient-accumulation hook) and the full gradient is freed at once: 1/M of the gradients.
- ZeRO-3 (FSDP): the parameters themselves are sharded per unit (one Transformer block, plus the
  root's embedding/norm/unembedding). Just before a unit runs its parameters are all-gathered,
  and they are freed right after; backward all-gathers them again and reduce-scatters the
  gradients (the all-gather's dual, Book of LLMs §6.2 “collectives”). The next unit is prefetched while the
  current one computes. Communication is 1.5× DDP (two all-gathers + one reduce-scatter).

Sharding is over a flat view: a tensor of n elements is padded to M·c (c = ⌈n/M⌉) and rank r
owns elements [r·c, (r+1)·c). When every n divides by M the per-rank bytes are exactly 1/M
(what ``lmstack.accounting.memory.training_memory_per_device`` predicts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.parallel import collectives as C
from lmstack.parallel.ddp import broadcast_module


def _pad_flat(t: Tensor, M: int) -> Tensor:
    flat = t.reshape(-1)
    c = math.ceil(flat.numel() / M)
    if c * M == flat.numel():
        return flat
    return F.pad(flat, (0, c * M - flat.numel()))


# ---- ZeRO-1 / ZeRO-2 ---------------------------------------------------------------------------


class ZeroOptimizer:
    """Wrap any optimizer class so that each rank holds the optimizer states (and, at stage 2,
    the gradients) of only its 1/M slice of every parameter.

        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, group, stage=1, lr=1e-3)
        loss.backward(); opt.step(); opt.zero_grad()

    ``param_groups`` are the inner optimizer's, so LR schedules work unchanged. The shard of a
    parameter is a view into the parameter itself (no extra fp32 copy) whenever its size
    divides by M; the inner optimizer updates it in place and the all-gather fills the rest.
    """

    def __init__(
        self,
        params: Iterable,
        optimizer_class: type,
        group=None,
        stage: int = 1,
        shard_groups: dict[int, object] | None = None,
        **defaults,
    ):
        """``shard_groups``: {id(parameter): process group} for parameters sharded over another group
        than ``group`` — expert parallelism's experts differ per ep rank, so their states are sharded
        (and gradients averaged) over the ranks holding the same experts (``mesh.group("edp")``)."""
        if stage not in (1, 2):
            raise ValueError(
                f"stage={stage}; ZeroOptimizer implements ZeRO-1 and ZeRO-2 (ZeRO-3 is FullyShard)"
            )
        self.group, self.stage = group, stage
        self.M = C.group_size(group)
        self.rank = C.group_ranks(group)[0] if self.M > 1 else 0
        self._groups = dict(shard_groups or {})
        groups = list(params)
        if not groups:
            raise ValueError("ZeroOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.params: list[nn.Parameter] = []
        self._shard: dict[int, Tensor] = {}
        inner_groups = []
        for g in groups:
            shards = []
            for p in g["params"]:
                if not p.requires_grad or id(p) in self._shard:
                    continue
                self.params.append(p)
                shard = self._make_shard(p)
                self._shard[id(p)] = shard
                shards.append(shard)
            inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": shards})
        self.inner = optimizer_class(inner_groups, **defaults)
        self._hooks = []
        self.require_sync = True
        self._reduced = False
        if stage == 2:
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._reduce_scatter_now) for p in self.params
            ]

    # a slice of the parameter's flat storage when possible (in-place update, no copy)
    def _where(self, p: Tensor) -> tuple[object, int, int]:
        """(group, size M, this rank's index) the parameter is sharded over."""
        if id(p) not in self._groups:
            return self.group, self.M, self.rank
        g = self._groups[id(p)]
        M = C.group_size(g)
        return g, M, (C.group_ranks(g)[0] if M > 1 else 0)

    def _make_shard(self, p: Tensor) -> Tensor:
        _, M, rank = self._where(p)
        n = p.numel()
        c = math.ceil(n / M)
        if n % M == 0 and p.is_contiguous():
            return p.data.view(-1)[rank * c : (rank + 1) * c]
        return _pad_flat(p.detach(), M)[rank * c : (rank + 1) * c].clone()

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def _reduce_scatter_grad(self, p: Tensor) -> None:
        shard = self._shard[id(p)]
        group, M, _ = self._where(p)
        g = C.reduce_scatter(_pad_flat(p.grad, M), group) / M  # (c,)
        shard.grad = g if shard.grad is None else shard.grad.add_(g)
        p.grad = None  # free the full gradient: only the 1/M shard is kept

    def _reduce_scatter_now(self, p: Tensor) -> None:
        """ZeRO-2: runs when p's gradient is accumulated during backward."""
        if self.require_sync:
            self._reduce_scatter_grad(p)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter the local gradients onto the shards (averaged over the group) now, so
        the shard gradients can be inspected or clipped before ``step``; ``step`` does it itself
        otherwise. Idempotent until the next ``step``/``zero_grad``."""
        if self._reduced:
            return
        if self.stage == 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._reduce_scatter_grad(p)
        else:
            for p in self.params:  # accumulated under no_sync, or got no gradient
                if p.grad is not None:
                    self._reduce_scatter_grad(p)
                elif self._shard[id(p)].grad is None:
                    self._shard[id(p)].grad = torch.zeros_like(self._shard[id(p)])
        self._reduced = True

    def shard_grads(self) -> list[tuple[nn.Parameter, Tensor | None]]:
        """(parameter, its shard's gradient) for every parameter, after ``reduce_gradients``."""
        return [(p, self._shard[id(p)].grad) for p in self.params]

    @torch.no_grad()
    def step(self, closure=None) -> None:
        self.reduce_gradients()
        self._reduced = False
        self.inner.step()
        for p in self.params:
            shard = self._shard[id(p)]
            full = C.all_gather(shard.detach(), self._where(p)[0])  # (M·c,)
            p.data.view(-1).copy_(full[: p.numel()])

    def state_dict(self) -> dict:
        """This rank's optimizer states (of its shards) and hyper-parameters: a per-rank checkpoint."""
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        """Restore ``state_dict()`` of the same rank, after the parameters were restored."""
        self.inner.load_state_dict(sd)
        self.refresh_shards()

    @torch.no_grad()
    def refresh_shards(self) -> None:
        """Re-read the shards that are copies (a size not divisible by M) from their parameters,
        e.g. after the parameters were loaded from a checkpoint; views follow by themselves."""
        for p in self.params:
            shard = self._shard[id(p)]
            c = shard.numel()
            if (
                shard.data_ptr() < p.data_ptr()
                or shard.data_ptr() >= p.data_ptr() + p.numel() * p.element_size()
            ):
                _, M, rank = self._where(p)
                shard.copy_(_pad_flat(p.detach(), M)[rank * c : (rank + 1) * c])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reduced = False
        for p in self.params:
            p.grad = None
            self._shard[id(p)].grad = None

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip by the global L2 norm of the gradient (the shards' squares summed over ranks).
        Call after backward, before ``step``: the gradients are reduce-scattered onto the shards
        first (``reduce_gradients``), for ZeRO-1 and ZeRO-2 alike."""
        self.reduce_gradients()
        sq = sum(
            float(s.grad.float().pow(2).sum()) for s in self._shard.values() if s.grad is not None
        )
        t = torch.tensor([sq], dtype=torch.float64, device=C.comm_device(self.group))
        C.all_reduce(t, self.group)
        norm = t.sqrt()[0]
        scale = max_norm / (float(norm) + 1e-6)
        if scale < 1:
            for s in self._shard.values():
                if s.grad is not None:
                    s.grad.mul_(scale)
        return norm

    def state_bytes(self) -> dict[str, int]:
        """Measured bytes this rank holds: parameters, gradients (full p.grad and shard grads)
        and optimizer states (every tensor in the inner optimizer's state, step counters aside)."""
        params = sum(p.numel() * p.element_size() for p in self.params)
        params += sum(
            s.numel() * s.element_size()
            for p, s in ((p, self._shard[id(p)]) for p in self.params)
            if s.data_ptr() < p.data_ptr()
            or s.data_ptr() >= p.data_ptr() + p.numel() * p.element_size()
        )
        grads = sum(
            p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None
        )
        grads += sum(
            s.grad.numel() * s.grad.element_size()
            for s in self._shard.values()
            if s.grad is not None
        )
        opt = sum(
            v.numel() * v.element_size()
            for st in self.inner.state.values()
            for k, v in st.items()
            if torch.is_tensor(v) and k != "step"
        )
        return {"master_weights": params, "gradients": grads, "optimizer": opt}


# ---- ZeRO-3 / FSDP -------------------------------------------------------------------------------


class _GatherParams(torch.autograd.Function):
    """Forward: all-gather the unit's parameter shards (one per segment) into its flat buffer
    (cast to the compute dtype). Backward: reduce-scatter each segment of the flat gradient (in
    fp32) onto its shard, divided by M (the data-parallel average), then free the buffer again."""

    @staticmethod
    def forward(ctx, unit: _Unit, *shards: Tensor) -> Tensor:
        ctx.unit = unit
        return unit.materialize()

    @staticmethod
    def backward(ctx, g: Tensor):
        unit = ctx.unit
        grads = []
        for seg, shard in zip(unit.segments, unit.shards):
            part = g[seg.base : seg.base + unit.M * seg.c].float()
            grads.append(
                (C.reduce_scatter(part, unit.group) / unit.M).to(shard.dtype).view(shard.shape)
            )
        unit.free()
        return (None, *grads)


@dataclass
class _Segment:
    """One class of a unit's parameters (e.g. matrices, or 1-D gains/biases) laid out flat:
    ``numel`` elements padded to M·c at offset ``base`` of the unit's buffer."""

    key: object
    numel: int
    c: int
    base: int
    matrix: bool


class _Unit:
    """The directly owned parameters of one module (not those of its sub-units), flattened.

    The flat buffer is split into segments by ``owner.segment_key(p)`` (default: matrix or not);
    each segment is sharded on its own, so every shard holds one class of parameters. A shard of
    matrices is (1, c), of vectors (c,): optimizer rules that look at ``p.dim()`` (weight decay on
    matrices only) see the same classes as on the unsharded model."""

    def __init__(
        self, owner: FullyShard, name: str, entries: list[tuple[nn.Module, str, nn.Parameter]]
    ):
        self.owner, self.name, self.group, self.M = owner, name, owner.group, owner.M
        uniq: dict[int, nn.Parameter] = {}
        for _, _, p in entries:
            uniq.setdefault(id(p), p)
        by_key: dict[object, list[nn.Parameter]] = {}
        for p in uniq.values():
            by_key.setdefault(owner.segment_key(p), []).append(p)
        offsets: dict[int, int] = {}
        self.segments: list[_Segment] = []
        self.shards: list[nn.Parameter] = []
        base = 0
        r = owner.rank
        for key, ps in by_key.items():
            n = sum(p.numel() for p in ps)
            seg = _Segment(key, n, math.ceil(n / self.M), base, all(p.dim() >= 2 for p in ps))
            off = base
            for p in ps:
                offsets[id(p)] = off
                off += p.numel()
            flat = _pad_flat(
                torch.cat([p.detach().reshape(-1).to(owner.master_dtype) for p in ps]), self.M
            )
            shard = flat[r * seg.c : (r + 1) * seg.c].clone()
            self.shards.append(nn.Parameter(shard.view(1, -1) if seg.matrix else shard))
            owner.shard_keys[id(self.shards[-1])] = key
            self.segments.append(seg)
            base += self.M * seg.c
        self.size = base  # buffer elements (padded segments)
        self.numel = sum(p.numel() for p in uniq.values())
        self.entries = [
            (mod, attr, offsets[id(p)], p.shape) for mod, attr, p in entries
        ]  # (module, attr, offset, shape)
        for mod, attr, _ in entries:
            del mod._parameters[attr]
            setattr(mod, attr, None)
        self.buffer: Tensor | None = None  # (size,) in the compute dtype
        self.full: Tensor | None = None  # the autograd output viewing ``buffer``
        self._work = None
        self.gathered = False

    def _alloc(self) -> Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(
                self.size, dtype=self.owner.param_dtype, device=self.shards[0].device
            )
        else:
            self.buffer.untyped_storage().resize_(self.size * self.buffer.element_size())
        return self.buffer

    def prefetch(self, ahead: bool = False) -> None:
        """Start the all-gathers now (async with torch's collective) so they overlap compute;
        ``ahead``: issued for the next unit while the current one computes."""
        if self.gathered or self._work is not None:
            return
        if ahead:
            self.owner.prefetched += 1
        buf = self._alloc()
        works = []
        for seg, shard in zip(self.segments, self.shards):
            src = shard.detach().reshape(-1).to(self.owner.param_dtype)
            out = buf.data[seg.base : seg.base + self.M * seg.c]
            if self.M == 1:
                out.copy_(src)
            elif C.use_ring("auto"):
                C.all_gather(src, self.group, out=out)
            else:
                works.append(C.all_gather_into(out, src, self.group, async_op=True))
        self._work = works or "done"

    def materialize(self) -> Tensor:
        self.prefetch()
        if self._work not in (None, "done"):
            for w in self._work:
                w.wait()
        self._work = None
        self.gathered = True
        self.owner._live[self.buffer.untyped_storage().data_ptr()] = self
        # a fresh tensor object on the same storage: autograd output of this gather only
        return torch.empty(0, dtype=self.buffer.dtype, device=self.buffer.device).set_(
            self.buffer.untyped_storage(), 0, self.buffer.shape
        )

    def gather(self) -> None:
        """Pre-forward: all-gather (through the autograd function) and point the module
        attributes at views of the full flat buffer."""
        if self.gathered and self.full is not None:
            return
        full = _GatherParams.apply(self, *self.shards)
        self.full = full
        for mod, attr, off, shape in self.entries:
            setattr(mod, attr, full[off : off + math.prod(shape)].view(shape))

    def regather(self) -> None:
        """Backward: the views saved by autograd point at the freed buffer; refill it."""
        if not self.gathered:
            self.materialize()

    def free(self) -> None:
        if self.buffer is not None and self.gathered:
            self.owner._live.pop(self.buffer.untyped_storage().data_ptr(), None)
            self.buffer.untyped_storage().resize_(0)
        self.gathered = False

    def drop_views(self) -> None:
        """After the forward: free the storage; the module attributes keep their (now empty) views."""
        self.free()
        self.full = None

    def full_flat(self) -> Tensor:
        """All-gather the master shards (a collective): the unit's flat fp32 buffer (size,)."""
        return torch.cat([C.all_gather(s.detach().reshape(-1), self.group) for s in self.shards])


class FullyShard(nn.Module):
    """ZeRO-3 / FSDP over ``group``: ``units`` (default: every ``model.blocks[i]``, plus the root)
    hold only 1/M of their parameters between uses.

    ``param_dtype`` is the compute dtype of the gathered parameters (bf16 for mixed precision);
    the shards — the parameters the optimizer sees, ``self.parameters()`` — stay in
    ``master_dtype`` (fp32), and gradients are reduce-scattered in fp32.

    ``segment_key(p)``: parameters of one unit with different keys go to different flat shards
    (default: matrices vs vectors, so weight decay can tell them apart; the parallel plan adds
    "split over tp or replicated" for the gradient norm). ``shard_keys[id(shard)]`` is its key.
    Frozen parameters (``requires_grad=False``) are not sharded: they stay in their modules,
    replicated (broadcast from rank 0 like the rest).
    """

    def __init__(
        self,
        model: nn.Module,
        group=None,
        units: list[nn.Module] | None = None,
        param_dtype: torch.dtype = torch.float32,
        master_dtype: torch.dtype = torch.float32,
        prefetch: bool = True,
        broadcast: bool = True,
        segment_key: Callable[[nn.Parameter], object] | None = None,
    ):
        super().__init__()
        self.segment_key = segment_key or (lambda p: p.dim() >= 2)
        self.shard_keys: dict[int, object] = {}
        self.group, self.M = group, C.group_size(group)
        self.rank = C.group_ranks(group)[0] if self.M > 1 else 0
        self.param_dtype, self.master_dtype = param_dtype, master_dtype
        self.prefetch_next = prefetch
        if broadcast and self.M > 1:
            broadcast_module(model, group)
        self.module = model
        if units is None:
            units = list(getattr(model, "blocks", []))
        self._live: dict[int, _Unit] = {}
        self.prefetched = 0  # all-gathers started one unit ahead (forward and backward)
        seen: set[int] = set()
        self.units: list[_Unit] = []
        unit_modules = list(units)
        for i, um in enumerate(unit_modules):
            self.units.append(_Unit(self, f"unit{i}", self._collect(um, seen)))
        self.root = _Unit(self, "root", self._collect(model, seen))
        if not self.root.entries:
            self.root = None
        self.shards = nn.ParameterList([s for u in self.all_units() for s in u.shards])
        self._order = {id(um): i for i, um in enumerate(unit_modules)}
        for i, um in enumerate(unit_modules):
            um.register_forward_pre_hook(self._make_pre(i))
            um.register_forward_hook(self._make_post(i))

    @staticmethod
    def _collect(module: nn.Module, seen: set[int]) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """Parameters directly owned by ``module``'s subtree and not yet claimed by a unit; a tied
        parameter that appears under two names is listed twice (both names get the same view)."""
        out, mine = [], set()
        for mod in module.modules():
            for attr, p in list(mod._parameters.items()):
                if p is None or not p.requires_grad or (id(p) in seen and id(p) not in mine):
                    continue  # frozen parameters stay where they are, replicated
                seen.add(id(p))
                mine.add(id(p))
                out.append((mod, attr, p))
        return out

    def _make_pre(self, i: int):
        def hook(mod, args):
            u = self.units[i]
            u.gather()
            if self.prefetch_next and i + 1 < len(self.units):
                self.units[i + 1].prefetch(ahead=True)

        return hook

    def _make_post(self, i: int):
        def hook(mod, args, out):
            self.units[i].drop_views()

        return hook

    # saved-tensor hooks: remember which unit a saved parameter view belongs to, regather on use
    def _pack(self, t: Tensor):
        try:
            u = self._live.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            u = None
        return (u, t) if u is not None else t

    def _unpack(self, packed):
        if isinstance(packed, tuple):
            u, t = packed
            u.regather()
            if u.owner.prefetch_next and u in self.units:  # backward runs units in reverse
                i = self.units.index(u)
                if i > 0:
                    self.units[i - 1].prefetch(ahead=True)
            return t
        return packed

    def forward(self, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            if self.root is not None:
                self.root.gather()
            try:
                return self.module(*args, **kwargs)
            finally:
                if self.root is not None:
                    self.root.drop_views()

    def full_state_dict(self) -> dict[str, Tensor]:
        """All-gather every unit and return the unsharded parameters by their original names."""
        out = {}
        names = {}
        for name, mod in self.module.named_modules():
            names[id(mod)] = name
        for u in self.all_units():
            full = u.full_flat()
            for mod, attr, off, shape in u.entries:
                key = f"{names[id(mod)]}.{attr}" if names[id(mod)] else attr
                out[key] = full[off : off + math.prod(shape)].view(shape).clone()
        for name, p in self.module.named_parameters():  # frozen, unsharded
            out[name] = p.detach().clone()
        return out

    def all_units(self) -> list[_Unit]:
        return self.units + ([self.root] if self.root is not None else [])

    def state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        params = sum(s.numel() * s.element_size() for s in self.shards)
        grads = sum(
            s.grad.numel() * s.grad.element_size() for s in self.shards if s.grad is not None
        )
        opt = 0
        if optimizer is not None:
            opt = sum(
                v.numel() * v.element_size()
                for st in optimizer.state.values()
                for k, v in st.items()
                if torch.is_tensor(v) and k != "step"
            )
        return {"master_weights": params, "gradients": grads, "optimizer": opt}
