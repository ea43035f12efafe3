"""Data parallelism: naive per-parameter all-reduce and bucketed all-reduce overlapped with backward.

Book of LLMs §6.4 "原生数据并行": split the batch B over M devices, run forward/backward locally,
all-reduce the gradients so every device holds the average, and let every device apply the
same update; communication happens only in the backward pass. CS336 notes "数据并行" and
"基本操作" (splitting one big all-reduce into pieces lets communication overlap computation).

``DataParallel(model, group, mode="bucketed")``:

- rank 0's parameters and buffers are broadcast at construction, so every replica starts equal;
- ``mode="naive"``: after the whole backward, one blocking all-reduce per parameter;
- ``mode="bucketed"``: parameters are grouped, in reverse registration order (≈ the order their
  gradients become ready), into buckets of ``bucket_mb`` MB; a hook on each parameter's gradient
  accumulation marks it ready, and a bucket whose parameters are all ready is flattened and
  all-reduced asynchronously while backward continues; the end of backward waits and copies
  the averaged gradients back;
- tied parameters are one ``nn.Parameter`` (counted and reduced once); frozen parameters
  (``requires_grad=False``) are skipped; parameters that got no gradient this step are reduced
  as zeros so every rank issues the same collectives;
- ``no_sync()`` skips communication so micro-batches accumulate locally (gradient
  accumulation); the next synchronised backward reduces the accumulated sum.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from lmstack.parallel import collectives as C


class GradSyncWrapper(nn.Module):
    """What every gradient-averaging wrapper shares: forward is the wrapped module's, and ``no_sync()``
    accumulates gradients locally (no communication) while ``require_sync`` is off."""

    require_sync = True

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside this context."""
        prev = self.require_sync
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = prev

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class DataParallel(GradSyncWrapper):
    """Wrap ``module`` for data parallelism over ``group``; forward is the module's forward."""

    def __init__(
        self,
        module: nn.Module,
        group=None,
        mode: str = "bucketed",
        bucket_mb: float = 25.0,
        broadcast: bool = True,
        impl: str = "auto",
    ):
        super().__init__()
        if mode not in ("naive", "bucketed"):
            raise ValueError(f"mode={mode!r}; expected 'naive' or 'bucketed'")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be > 0")
        self.module = module
        self.group = group
        self.mode = mode
        self.impl = impl
        self.world = C.group_size(group)
        self.require_sync = True
        self._params = [p for p in _unique_params(module) if p.requires_grad]
        if broadcast:
            with torch.no_grad():
                for t in list(_unique_params(module)) + list(module.buffers()):
                    C.broadcast(t.data, 0, group)
        # buckets in reverse order: the last layers' gradients are ready first
        self.buckets: list[list[nn.Parameter]] = []
        limit = bucket_mb * 2**20
        cur, size = [], 0
        for p in reversed(self._params):
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                self.buckets.append(cur)
                cur, size = [], 0
        if cur:
            self.buckets.append(cur)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        # buckets launched from a gradient hook, i.e. while backward was still running (overlap)
        self.launched_during_backward = 0
        self._reset_step()

    # ---- hooks -------------------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._pending: list[tuple[int, Tensor, object]] = []
        self._launched = [False] * len(self.buckets)
        self._callback_queued = False

    def _on_grad_ready(self, p: Tensor) -> None:
        if not self.require_sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        if self.mode == "naive":
            return
        b = self._bucket_of[id(p)]
        self._ready[b] += 1
        if self._ready[b] == len(self.buckets[b]):
            self._launch(b)
            self.launched_during_backward += 1

    def _launch(self, b: int) -> None:
        params = self.buckets[b]
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        work = C.all_reduce(
            flat, self.group, impl=self.impl, async_op=True
        )  # overlaps the rest of backward
        self._pending.append((b, flat, work))
        self._launched[b] = True

    def _finish(self) -> None:
        """End of backward: naive all-reduces every parameter now; bucketed waits for the
        in-flight buckets (and launches those whose parameters got no gradient)."""
        if self.mode == "naive":
            for p in self._params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                C.all_reduce(p.grad, self.group, impl=self.impl)
                p.grad.div_(self.world)
        else:
            for b in range(len(self.buckets)):
                if not self._launched[b]:
                    self._launch(b)
            for b, flat, work in self._pending:
                if work is not None:
                    work.wait()
                flat.div_(self.world)
                offset = 0
                for p in self.buckets[b]:
                    n = p.numel()
                    g = flat[offset : offset + n].view_as(p)
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
                    offset += n
        self._reset_step()


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters once each (a tied embedding/unembedding is one parameter)."""
    return list(module.parameters())  # nn.Module.parameters() already deduplicates


def broadcast_module(module: nn.Module, group=None, src_in_group: int = 0) -> None:
    """Make every rank of ``group`` hold the parameters and buffers of rank ``src_in_group``."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            C.broadcast(t.data, src_in_group, group)
