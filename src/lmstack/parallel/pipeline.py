"""Pipeline parallelism: stages by layer ranges, micro-batches, GPipe, 1F1B and zero-bubble.

Book of LLMs §6.5 (naive model parallelism idles every device but one; splitting the batch into
micro-batches lets stages work at once), CS336 notes "流水线并行" (the bubble needs a large batch;
splitting backward into the input gradient B — needed by the previous stage at once — and the
weight gradient W — which can wait — lets W fill the bubbles: zero bubble).

Stage s of p runs layers [L·s/p, L·(s+1)/p) — the first stage also the embedding, the last the
final norm, unembedding and loss — as a model of the model's own class holding that slice,
through the model's own forward (``pipeline_stage``). Activations (B/m, S, D) go forward with send/recv; their
gradients come back the same way. Schedules are lists of actions per stage:

  gpipe   F0 F1 … F(m-1)  B0 … B(m-1)                 bubble (p-1)/(m+p-1), m micro-batches in flight
  1f1b    (p-s-1) warm-up F, then F/B alternating,     same bubble, at most p-s in flight
          then the remaining B
  zb      1F1B order with B split into B (input grad) and W (weight grad); W runs when the stage
          would otherwise wait (ZB-H1-like, found by list scheduling with unit costs)

``simulate`` replays a schedule with unit costs (F = 1, B = 2 or B = W = 1) and returns the
bubble fraction — exactly (p-1)/(m+p-1) for GPipe and 1F1B; ``PipelineParallel.train_step``
measures the real one from per-action timings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.model.layers import Linear
from lmstack.parallel import collectives as C

# ---- schedules ------------------------------------------------------------------------------------


def gpipe_schedule(p: int, m: int, s: int) -> list[tuple[str, int]]:
    """All forwards, then all backwards (GPipe)."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_schedule(p: int, m: int, s: int) -> list[tuple[str, int]]:
    """1F1B (PipeDream-flush): p-s-1 warm-up forwards, a steady F/B alternation, cool-down B."""
    warm = min(p - s - 1, m)
    out = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [("F", warm + i), ("B", i)]
    out += [("B", i) for i in range(m - warm, m)]
    return out


def zero_bubble_schedule(p: int, m: int) -> list[list[tuple[str, int]]]:
    """B/W split schedule for all p stages (ZB-H1-like). List scheduling with unit costs: each
    free stage takes, in order of priority, a ready B, a ready F (at most p-s in flight, the
    1F1B memory bound), else a pending W. Returns one action list per stage."""
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> finish time
    nxt_f = [0] * p
    in_flight = [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    orders: list[list[tuple[str, int]]] = [[] for _ in range(p)]
    t = 0
    total = 3 * p * m
    while sum(len(o) for o in orders) < total:
        for s in range(p):
            # B for micro-batch i needs F(s, i) and B(s+1, i) (or, on the last stage, just F)
            cands_b = [
                i
                for i in range(m)
                if ("F", s, i) in done
                and done[("F", s, i)] <= t
                and ("B", s, i) not in done
                and (s == p - 1 or (("B", s + 1, i) in done and done[("B", s + 1, i)] <= t))
            ]
            if cands_b:
                i = min(cands_b)
                done[("B", s, i)] = t + 1
                orders[s].append(("B", i))
                in_flight[s] -= 1
                pending_w[s].append(i)
                continue
            i = nxt_f[s]
            if (
                i < m
                and in_flight[s] < p - s
                and (s == 0 or (("F", s - 1, i) in done and done[("F", s - 1, i)] <= t))
            ):
                done[("F", s, i)] = t + 1
                orders[s].append(("F", i))
                nxt_f[s] += 1
                in_flight[s] += 1
                continue
            if pending_w[s]:
                i = pending_w[s].pop(0)
                done[("W", s, i)] = t + 1
                orders[s].append(("W", i))
        t += 1
        if t > 10 * total:
            raise RuntimeError("zero-bubble list scheduling did not converge")
    return orders


def schedule(kind: str, p: int, m: int) -> list[list[tuple[str, int]]]:
    """Per-stage action lists for ``kind`` in {"gpipe", "1f1b", "zb"}."""
    if m < 1 or p < 1:
        raise ValueError(f"pipeline needs p >= 1 stages and m >= 1 micro-batches, got p={p}, m={m}")
    if kind == "gpipe":
        return [gpipe_schedule(p, m, s) for s in range(p)]
    if kind == "1f1b":
        return [one_f_one_b_schedule(p, m, s) for s in range(p)]
    if kind == "zb":
        return zero_bubble_schedule(p, m)
    raise ValueError(f"schedule={kind!r}; expected 'gpipe', '1f1b' or 'zb'")


def simulate(
    orders: list[list[tuple[str, int]]], cost: dict[str, float] | None = None
) -> dict[str, float]:
    """Replay per-stage orders with unit costs (default F=1, B=2 without W, or B=W=1 with W).
    Returns makespan, busy time per stage and the bubble fraction 1 - busy / (p · makespan)."""
    p = len(orders)
    split = any(k == "W" for o in orders for k, _ in o)
    cost = cost or ({"F": 1.0, "B": 1.0, "W": 1.0} if split else {"F": 1.0, "B": 2.0})
    finish: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * p
    idx = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while idx[s] < len(orders[s]):
                k, i = orders[s][idx[s]]
                deps = []
                if k == "F" and s > 0:
                    deps.append(("F", s - 1, i))
                if k == "B":
                    deps.append(("F", s, i))
                    if s < p - 1:
                        deps.append(("B", s + 1, i))
                if k == "W":
                    deps.append(("B", s, i))
                if any(d not in finish for d in deps):
                    break
                start = max([clock[s]] + [finish[d] for d in deps])
                clock[s] = finish[(k, s, i)] = start + cost[k]
                idx[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlocks: an action waits for one that never runs")
    makespan = max(clock)
    busy = sum(cost[k] for o in orders for k, _ in o)
    return {"makespan": makespan, "bubble": 1 - busy / (p * makespan)}


def bubble_formula(p: int, m: int) -> float:
    """Book of LLMs §6.5 “pipeline parallelism and 1F1B” / CS336 notes: bubble fraction (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


# ---- zero-bubble weight-gradient split --------------------------------------------------------------


class _WeightGradStash:
    def __init__(self):
        self.items: dict[int, list[tuple[Tensor, Tensor, Tensor]]] = {}
        self.current = 0

    def add(self, weight: Tensor, x: Tensor, g: Tensor) -> None:
        self.items.setdefault(self.current, []).append((weight, x, g))

    def run(self, mb: int) -> None:
        """The W pass of micro-batch ``mb``: dL/dW = gᵀ x for every stashed linear."""
        for w, x, g in self.items.pop(mb, []):
            dw = g.reshape(-1, g.shape[-1]).t().to(w.dtype) @ x.reshape(-1, x.shape[-1]).to(
                w.dtype
            )  # (O, I)
            w.grad = dw if w.grad is None else w.grad.add_(dw)


class _SplitLinearFn(torch.autograd.Function):
    """y = x Wᵀ whose backward computes only dx = g W (the B pass) and stashes (x, g) so the
    weight gradient gᵀ x can run later (the W pass)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, stash: _WeightGradStash):
        ctx.save_for_backward(x, weight)
        ctx.stash = stash
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, weight = ctx.saved_tensors
        if weight.requires_grad:  # a frozen weight gets no W pass
            ctx.stash.add(weight, x.detach(), g.detach())
        return g @ weight.to(g.dtype), None, None


class SplitWeightGradLinear(nn.Module):
    """Wraps a bias-free linear (``.weight`` (O, I)) for the zero-bubble B/W split."""

    def __init__(self, linear: nn.Module, stash: _WeightGradStash):
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError("zero-bubble split: linears with a bias are not supported")
        self.inner, self.stash = linear, stash

    @property
    def weight(self):
        return self.inner.weight

    def forward(self, x: Tensor) -> Tensor:
        return _SplitLinearFn.apply(x, self.inner.weight, self.stash)


# ---- stages -----------------------------------------------------------------------------------------


def stage_layers(L: int, p: int, s: int) -> tuple[int, int]:
    """Layers [start, end) of stage s: as even as possible, earlier stages take the remainder."""
    base, extra = divmod(L, p)
    start = s * base + min(s, extra)
    return start, start + base + (1 if s < extra else 0)


def pipeline_stage(model: nn.Module, s: int, p: int) -> nn.Module:
    """Stage s of p: a model of ``model``'s own class holding blocks[a:b] — the embedding only on
    the first stage, the final norm and unembedding only on the last — run by the model's own
    forward (tokens or hidden states (B, S, D) in; hidden states or logits out). The modules are
    ``model``'s, shared, not copied; only a last stage with tied embeddings that is not also the
    first gets its own copy of W_e as ``lm_head`` (``PipelineParallel.sync_tied`` sums the two
    gradients)."""
    L = len(model.blocks)
    if p > L:
        raise ValueError(f"pipeline: pp={p} stages exceed n_layers={L}")
    a, b = stage_layers(L, p, s)
    first, last = s == 0, s == p - 1
    with torch.device("meta"):  # the frame only; every module below is the model's
        stage = type(model)(model.config)
    stage.rope = model.rope
    stage.blocks = nn.ModuleList(model.blocks[a:b])
    stage.embed = model.embed if first else None
    stage.norm = model.norm if last else None
    stage.lm_head = model.lm_head if last else None
    if last and model.lm_head is None and not first:
        w = model.embed.weight  # (V, D) [TP: (V/tp, D)]
        stage.lm_head = Linear(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype)
        stage.lm_head.weight = nn.Parameter(w.detach().clone())
    stage.activation_checkpointing = model.activation_checkpointing
    stage.train(model.training)
    return stage


def split_weight_grads(stage: nn.Module) -> _WeightGradStash:
    """Zero-bubble: every linear of ``stage`` (blocks and unembedding) computes its weight
    gradient in a later W pass; returns the stash that holds the pending (x, g) pairs."""
    stash = _WeightGradStash()
    for blk in stage.blocks:
        for mod, names in (
            (blk.attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
            (blk.ffn, ("gate_proj", "up_proj", "down_proj")),
        ):
            for n in names:
                setattr(mod, n, SplitWeightGradLinear(getattr(mod, n), stash))
    if stage.lm_head is not None:
        stage.lm_head = SplitWeightGradLinear(stage.lm_head, stash)
    return stash


@dataclass
class StepTimes:
    busy: float  # seconds this stage spent computing F/B/W
    wall: float  # seconds from the common start to the end of this stage's last action


_EVAL_TAG = 1 << 20  # send/recv tag of the forward-only pass, apart from the schedules' 2i / 2i+1


class PipelineParallel(nn.Module):
    """Run one stage of a pipeline over ``group`` (the pp axis), ``micro_batches`` m per step.

        pipe = PipelineParallel(model, group, micro_batches=4, schedule_kind="1f1b")
        loss = pipe.train_step(tokens, targets, loss_fn)   # backward done; step your optimizer
        pipe.parameters()                                  # this stage's parameters only

    ``dp_group``: gradients are averaged over it after the schedule (DP×PP). ``vocab_group``:
    tensor-parallel stages, the last one all-gathers its vocab-sharded logits over it.
    """

    def __init__(
        self,
        model: nn.Module,
        group=None,
        micro_batches: int = 4,
        schedule_kind: str = "1f1b",
        dp_group=None,
        tied_group=None,
        vocab_group=None,
    ):
        super().__init__()
        if C.group_size(group) > 1:
            self.rank_in, self.p, self.ranks = C.group_ranks(group)
        else:
            self.rank_in, self.p, self.ranks = (
                0,
                1,
                [dist.get_rank()] if dist.is_initialized() else [0],
            )
        self.group, self.m, self.kind = group, micro_batches, schedule_kind
        self.orders = schedule(schedule_kind, self.p, micro_batches)
        self.first, self.last = self.rank_in == 0, self.rank_in == self.p - 1
        self.d_model, self.vocab_size = model.config.d_model, model.config.vocab_size
        self.tied = model.lm_head is None
        self.stage = pipeline_stage(model, self.rank_in, self.p)
        # the last stage's copy of a tied W_e (None elsewhere)
        self.tied_copy = (
            self.stage.lm_head.weight if self.last and self.tied and not self.first else None
        )
        self.stash = split_weight_grads(self.stage) if schedule_kind == "zb" else None
        self.vocab_group = vocab_group
        self.dp_group = dp_group
        self.tied_group = tied_group  # {first, last} stage ranks when embeddings are tied
        self.last_times: StepTimes | None = None
        self._device = next(self.stage.parameters()).device
        self._parts_loss = (
            None  # (loss_fn, state) of train_parts: one function object for every step
        )

    def run_stage(self, x: Tensor) -> Tensor:
        """This stage's forward: tokens (B, S) or (B, S, D) in; (B, S, D) or, last, logits (B, S, V)."""
        out = self.stage(x)
        if self.last and self.vocab_group is not None:  # (B, S, V/tp) -> (B, S, V)
            out = C.GatherFn.apply(out, out.dim() - 1, self.vocab_group)
        return out

    def _send(self, t: Tensor, to: int, tag: int):
        return dist.isend(t.contiguous(), self.ranks[to], tag=tag)

    def _recv(self, shape, dtype, frm: int, tag: int) -> Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self._device)
        dist.recv(buf, self.ranks[frm], tag=tag)
        return buf

    def train_step(self, tokens: Tensor, targets: Tensor, loss_fn) -> float:
        """Forward and backward of one batch (B, S) in m micro-batches; returns the mean loss
        (broadcast from the last stage). Gradients are left in ``.grad`` (averaged over dp)."""
        B, S = tokens.shape
        if B % self.m:
            raise ValueError(f"pipeline: batch B={B} is not divisible by micro_batches={self.m}")
        s = self.rank_in
        xs, ys = tokens.chunk(self.m), targets.chunk(self.m)
        act_shape = (B // self.m, S, self.d_model)
        inputs, outputs, losses = {}, {}, {}
        sends = []
        busy = 0.0
        if dist.is_initialized():
            dist.barrier(group=self.group)
        t0 = time.perf_counter()
        for kind, i in self.orders[s]:
            if kind == "F":
                x = xs[i] if self.first else self._recv(act_shape, torch.float32, s - 1, 2 * i)
                if not self.first:
                    x.requires_grad_(True)
                ta = time.perf_counter()
                out = self.run_stage(x)
                if self.last:
                    loss = loss_fn(out, ys[i]) / self.m
                    losses[i] = float(loss.detach())
                    out = loss
                busy += time.perf_counter() - ta
                inputs[i], outputs[i] = x, out
                if not self.last:
                    sends.append(self._send(out.detach(), s + 1, 2 * i))
            elif kind == "B":
                g = (
                    None
                    if self.last
                    else self._recv(outputs[i].shape, outputs[i].dtype, s + 1, 2 * i + 1)
                )
                ta = time.perf_counter()
                if self.stash is not None:
                    self.stash.current = i
                torch.autograd.backward(outputs[i], g)
                busy += time.perf_counter() - ta
                if not self.first:
                    sends.append(self._send(inputs[i].grad, s - 1, 2 * i + 1))
                del outputs[i], inputs[i]
            else:  # W
                ta = time.perf_counter()
                self.stash.run(i)
                busy += time.perf_counter() - ta
        for w in sends:
            w.wait()
        self.last_times = StepTimes(busy=busy, wall=time.perf_counter() - t0)
        self.sync_grads()
        loss = torch.tensor(
            [sum(losses.values())], dtype=torch.float64, device=C.comm_device(self.group)
        )
        if self.p > 1:
            dist.broadcast(loss, self.ranks[-1], group=self.group)
        return float(loss)

    def train_parts(self, tokens: Tensor, targets: Tensor, loss_parts) -> Tensor:
        """``train_step`` for a loss in parts: ``loss_parts(logits, y) -> (ce, z)`` runs on the last
        stage, each micro-batch's ce + z scaled by 1/m. Returns [mean ce, mean z] over the
        micro-batches (float64), the same on every rank of the pipeline."""
        parts: list[Tensor] = []
        if (
            self._parts_loss is None
        ):  # one function object for every step (torch's schedules cache it)
            state = {}

            def loss_fn(logits, y):
                ce, z = state["parts_fn"](logits, y)
                state["parts"].append(torch.stack([ce.detach().double(), z.detach().double()]))
                return ce + z

            self._parts_loss = (loss_fn, state)
        loss_fn, state = self._parts_loss
        state["parts_fn"], state["parts"] = loss_parts, parts
        self.train_step(tokens, targets, loss_fn)
        dev = C.comm_device(self.group)
        # torch's schedules may run the loss once more on their first step (shape inference): keep the last m
        parts = [t for t in parts if t.device.type != "meta"][-self.m :]
        out = (torch.stack(parts).mean(0) if parts else torch.zeros(2, dtype=torch.float64)).to(dev)
        if self.p > 1:
            dist.broadcast(out, self.ranks[-1], group=self.group)
        return out.cpu()

    def sync_grads(self) -> None:
        """After a schedule: the tied W_e's two copies summed, then the average over dp."""
        self.sync_tied()
        if self.dp_group is not None and C.group_size(self.dp_group) > 1:
            self.dp_average()

    def sync_tied(self) -> None:
        """Tied W_e on the first and last stages: sum their gradients (one parameter in two places)."""
        if self.p == 1 or not self.tied or not (self.first or self.last):
            return
        w = self.stage.embed.weight if self.first else self.tied_copy
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        C.all_reduce(w.grad, self.tied_group)

    def dp_average(self) -> None:
        """Average this stage's gradients over ``dp_group`` in one flat all-reduce."""
        params = [q for q in self.stage.parameters() if q.requires_grad]
        for q in params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        C.all_reduce(flat, self.dp_group)
        flat /= C.group_size(self.dp_group)
        off = 0
        for q in params:
            q.grad.copy_(flat[off : off + q.numel()].view_as(q))
            off += q.numel()

    def forward(
        self, tokens: Tensor, positions: Tensor | None = None, document_ids: Tensor | None = None
    ) -> Tensor:
        """Evaluation only (under no_grad): the stages run in turn without micro-batches — stage s
        receives (B, S, D) from s - 1 and sends its output to s + 1 — and the last stage's logits
        (B, S, V) are broadcast to every rank of the pipeline, so each computes the same loss.
        Training runs forward and backward together: ``train_step``."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                "a pipeline runs forward and backward together: call "
                "train_step(tokens, targets, loss_fn) (forward alone only under torch.no_grad())"
            )
        if positions is not None or document_ids is not None:
            raise ValueError(
                "pipeline parallelism: positions/document_ids (packing) are not supported"
            )
        B, S = tokens.shape
        dev = self._device
        x = tokens.to(dev) if self.first else torch.empty(B, S, self.d_model, device=dev)
        if not self.first:
            dist.recv(x, self.ranks[self.rank_in - 1], tag=_EVAL_TAG)
        out = (
            self.run_stage(x).float().contiguous()
        )  # (B, S, V); the tp vocab gather returns a strided view
        if not self.last:
            dist.send(out, self.ranks[self.rank_in + 1], tag=_EVAL_TAG)
            out = torch.empty(B, S, self.vocab_size, device=dev)
        if self.p > 1:
            dist.broadcast(out, self.ranks[-1], group=self.group)
        return out

    def measured_bubble(self) -> float:
        """1 - (compute time of all stages) / (p · slowest stage's wall time) for the last step."""
        t = self.last_times
        if t is None:
            raise RuntimeError("no step measured yet")
        vals = torch.tensor([t.busy, t.wall], dtype=torch.float64, device=C.comm_device(self.group))
        if self.p > 1:
            busy = vals[:1].clone()
            dist.all_reduce(busy, group=self.group)
            wall = vals[1:].clone()
            dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=self.group)
            return float(1 - busy[0] / (self.p * wall[0]))
        return float(1 - vals[0] / vals[1])


def tied_embedding_groups(mesh) -> object:
    """Create (collectively, on every rank) the {first stage, last stage} groups of each pipeline
    and return this rank's, or None."""
    mine = None
    for ranks in mesh.all_groups("pp"):
        pair = sorted({ranks[0], ranks[-1]})
        g = dist.new_group(pair) if len(pair) > 1 else None
        if dist.get_rank() in pair:
            mine = g
    return mine
