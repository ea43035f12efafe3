"""Benchmarking and profiling harness: timing, peak memory, NVTX ranges, model step breakdown.

CS336 notes "工程细节 / 基准测试":
- time with ``timeit.default_timer`` (the highest-resolution clock), not ``time.time``;
- call ``torch.cuda.synchronize()`` before reading the clock, since CUDA launches are asynchronous;
- warm up before timing and take several repeats (median and min are reported);
- for memory, one warm-up step is needed too: AdamW allocates its state on the first
  ``optimizer.step()``, so a cold single step reports the wrong peak;
- NVTX ranges for Nsight Systems come from a context manager / decorator that is off by default,
  never from monkey patching the code under test.
Peak memory: CUDA memory statistics on a GPU; on CPU the process's resident set (VmHWM after
resetting it through /proc/self/clear_refs) or, for exact tensor bytes, the PyTorch profiler's
allocator events (``peak_tensor_bytes``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import resource
import statistics
import timeit
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from lmstack.kernels.backends import flash_attention
from lmstack.model.seam import reference_attention
from lmstack.utils import atomic_write_text, torch_dtype


# ---- NVTX ------------------------------------------------------------------------------------
@contextlib.contextmanager
def nvtx_range(name: str, enabled: bool = False) -> Iterator[None]:
    """Mark a region for Nsight Systems (``nsys profile``). Off unless ``enabled`` and CUDA is present."""
    if not (enabled and torch.cuda.is_available()):
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def nvtx_annotate(name: str | None = None, enabled: bool = False) -> Callable:
    """Decorator form of ``nvtx_range``: ``@nvtx_annotate("attention", enabled=args.nvtx)``."""

    def wrap(fn: Callable) -> Callable:
        label = name or fn.__qualname__

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with nvtx_range(label, enabled):
                return fn(*args, **kwargs)

        return inner

    return wrap


# ---- timing ----------------------------------------------------------------------------------
def synchronize(device: torch.device | str) -> None:
    """Drain queued device work so that the clock measures it (no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Seconds per call over ``repeats`` timed calls after ``warmup`` untimed ones."""

    median: float
    min: float
    mean: float
    repeats: int
    warmup: int
    times: list[float] = field(default_factory=list, repr=False)


def time_fn(
    fn: Callable[[], Any], device: torch.device | str = "cpu", warmup: int = 2, repeats: int = 5
) -> Timing:
    """Median / min wall time of ``fn()`` with warm-up and device synchronisation."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be ≥ 1 and warmup={warmup} ≥ 0")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = timeit.default_timer()
        fn()
        synchronize(device)
        times.append(timeit.default_timer() - t0)
    return Timing(
        statistics.median(times), min(times), statistics.fmean(times), repeats, warmup, times
    )


# ---- memory ----------------------------------------------------------------------------------
def _read_vm_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _read_rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _reset_vm_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset the peak resident set size to the current one
        return True
    except OSError:
        return False


@dataclass
class MemoryStats:
    """Peak bytes during a region, and how it was measured."""

    peak_bytes: int = 0  # peak during the region (CUDA: allocated; CPU: resident set)
    delta_bytes: int = 0  # peak minus what was in use when the region started
    method: str = ""


@contextlib.contextmanager
def track_peak_memory(device: torch.device | str = "cpu") -> Iterator[MemoryStats]:
    """``with track_peak_memory(dev) as m: ...`` then read ``m.peak_bytes`` / ``m.delta_bytes``."""
    device = torch.device(device)
    stats = MemoryStats()
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        try:
            yield stats
        finally:
            synchronize(device)
            stats.peak_bytes = torch.cuda.max_memory_allocated(device)
            stats.delta_bytes = stats.peak_bytes - start
            stats.method = "torch.cuda.max_memory_allocated"
        return
    start = _read_rss() or 0
    if _reset_vm_hwm():
        try:
            yield stats
        finally:
            stats.peak_bytes = _read_vm_hwm() or 0
            stats.delta_bytes = stats.peak_bytes - start
            stats.method = "RSS (VmHWM after clear_refs)"
        return
    try:
        yield stats
    finally:  # cannot reset the peak: the process-lifetime maximum
        stats.peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        stats.delta_bytes = stats.peak_bytes - start
        stats.method = "RSS (process lifetime ru_maxrss)"


def peak_tensor_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes of CPU tensors allocated (and not yet freed) while ``fn()`` runs.

    Reads the PyTorch profiler's allocator events (``profile_memory=True``): the running sum of
    every op's net allocation in time order. Exact tensor bytes, unaffected by the C allocator's
    caching, which makes it the right tool to show O(S) vs O(S²) growth.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


# ---- results ---------------------------------------------------------------------------------
def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    device = torch.device(device)
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def format_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A plain fixed-width text table of ``rows`` (floats to 4 significant digits)."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join([line, sep, *body])


def write_json(path: str, payload: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(payload, indent=2, default=str) + "\n")


# ---- benchmarks ------------------------------------------------------------------------------
def parse_dtype(name: str) -> torch.dtype:
    """``--dtype`` of the kernel benchmarks: fp32/bf16/fp16, or fp64 for reference checks."""
    return torch_dtype(name)


def attention_fn(backend: str, causal: bool = True) -> Callable:
    """(q, k, v) -> O for a backend name; ``sdpa_flash`` forces SDPA's FlashAttention kernel (CUDA)."""
    if backend in ("flash_pytorch", "flash_triton"):
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, backend=backend)
    if backend == "reference":

        def ref(q, k, v):
            T, S = q.shape[-2], k.shape[-2]
            mask = None
            if causal:
                mask = (
                    torch.arange(S, device=q.device)[None, :]
                    <= torch.arange(T, device=q.device)[:, None] + S - T
                )
            return reference_attention(q, k, v, mask)

        return ref
    if backend in ("sdpa", "sdpa_flash"):

        def sdpa(q, k, v):
            gqa = q.shape[1] != k.shape[1]
            if backend == "sdpa_flash":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        return sdpa
    raise ValueError(
        f"attention backend={backend!r}; expected reference, sdpa, sdpa_flash, flash_pytorch, flash_triton"
    )


def bench_attention(
    backend: str,
    B: int,
    N: int,
    K: int,
    S: int,
    H: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    causal: bool = True,
    backward: bool = True,
    warmup: int = 1,
    repeats: int = 3,
    memory: bool = True,
    nvtx: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Time one attention call (forward, or forward + backward) at (B, N, K, S, H); T = S."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def make(heads: int) -> torch.Tensor:
        return (
            torch.randn(B, heads, S, H, generator=gen)
            .to(device=device, dtype=dtype)
            .requires_grad_(backward)
        )

    q, k, v = make(N), make(K), make(K)
    fn = attention_fn(backend, causal)
    dout = torch.randn(B, N, S, H, generator=gen).to(device=device, dtype=dtype)

    def step() -> None:
        with nvtx_range(f"attention/{backend}/S={S}", nvtx):
            out = fn(q, k, v)
            if backward:
                q.grad = k.grad = v.grad = None
                out.backward(dout)

    t = time_fn(step, device, warmup, repeats)
    row: dict[str, Any] = {
        "backend": backend,
        "B": B,
        "N": N,
        "K": K,
        "S": S,
        "H": H,
        "dtype": str(dtype).removeprefix("torch."),
        "causal": causal,
        "pass": "fwd+bwd" if backward else "fwd",
        "median_ms": t.median * 1e3,
        "min_ms": t.min * 1e3,
    }
    if memory:
        if torch.device(device).type == "cuda":
            with track_peak_memory(device) as m:
                step()
            row["peak_mib"] = m.delta_bytes / 2**20
        else:
            row["peak_mib"] = (
                peak_tensor_bytes(step) / 2**20
            )  # tensor bytes the step allocated at its peak
    return row


def bench_model(
    model,
    batch: int,
    seq: int,
    runtime: dict[str, str] | None = None,
    warmup: int = 1,
    repeats: int = 3,
    nvtx: bool = False,
    lr: float = 1e-4,
) -> dict[str, Any]:
    """Forward / backward / optimizer-step breakdown of one training step of a built model
    (a ``Transformer``, its backends already configured; ``runtime``: the backend names, reported).

    Each phase is timed separately (synchronised before and after), as the seed suggests: copy the
    training step and put clock reads between the phases. The whole step's peak memory is taken
    after one warm-up step so that AdamW's state is already allocated.
    """
    config = model.config
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}

    def clock() -> float:
        synchronize(device)
        return timeit.default_timer()

    def step(record: bool) -> None:
        t0 = clock()
        with nvtx_range("forward", nvtx):
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten()
            )
        t1 = clock()
        with nvtx_range("backward", nvtx):
            loss.backward()
        t2 = clock()
        with nvtx_range("optimizer", nvtx):
            opt.step()
            opt.zero_grad(set_to_none=True)
        t3 = clock()
        if record:
            for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name].append(dt)

    for _ in range(max(1, warmup)):
        step(False)
    with track_peak_memory(device) as mem:
        step(False)
    for _ in range(repeats):
        step(True)
    rows = []
    total = [sum(x) for x in zip(*phases.values())]
    for name, times in [*phases.items(), ("step", total)]:
        rows.append(
            {"phase": name, "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}
        )
    return {
        "config": config.name,
        "params": model.num_params(),
        "batch": batch,
        "seq": seq,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        **(runtime or {}),
        "warmup": warmup,
        "repeats": repeats,
        "phases": rows,
        "tokens_per_s": batch * seq / statistics.median(total),
        "peak_memory_mib": mem.peak_bytes / 2**20,
        "peak_memory_delta_mib": mem.delta_bytes / 2**20,
        "memory_method": mem.method,
        "machine": machine_info(device),
    }


def as_dict(obj: Any) -> Any:
    return asdict(obj) if hasattr(obj, "__dataclass_fields__") else obj
