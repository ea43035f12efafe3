"""How many CPU threads a command may use: the CPUs this process can actually run on.

``os.cpu_count()`` counts the machine's CPUs, not this process's share: a container limited to
2 CPUs on a 64-core host, or a job pinned with ``taskset``, would start 64 threads that fight over
2 CPUs (a decode step then waits for the slowest, descheduled thread: on a busy 2-core machine
``lmstack generate`` ran at 1.2 tokens/s with 2 threads and 8.1 with one). ``available_cpus``
takes the smallest of

- the affinity mask (``os.sched_getaffinity``: taskset, cpusets, Slurm/Kubernetes pinning),
- the cgroup v2 CPU quota (``cpu.max`` = "quota period" in this process's cgroup and its parents),
- the cgroup v1 CFS quota (``cpu.cfs_quota_us / cpu.cfs_period_us``),

rounded down (a 1.5-CPU quota gives 1 thread), at least 1. Every command that computes has
``--threads N`` (``add_threads_argument``); ``lmstack`` calls ``set_threads`` once with it, so the
default is ``available_cpus()`` everywhere — or ``OMP_NUM_THREADS`` when that is set (torchrun sets
it to 1 per rank when it starts several ranks on one machine). It cannot see other jobs' load on CPUs this process
is allowed to use: on a shared machine pass a smaller ``--threads`` (``lmstack demo`` times one
thread against all of them and keeps the faster).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


def _quota_v2(cgroup_root: Path, rel: str) -> float | None:
    """The smallest ``cpu.max`` quota (in CPUs) from this cgroup up to the root; None when unlimited."""
    best = None
    d = cgroup_root / rel.lstrip("/")
    while True:
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
            if quota != "max":
                cpus = int(quota) / int(period)
                best = cpus if best is None else min(best, cpus)
        except (OSError, ValueError):
            pass
        if d == cgroup_root or d.parent == d:
            return best
        d = d.parent


def _quota_v1(cgroup_root: Path) -> float | None:
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        try:
            quota = int((cgroup_root / name / "cpu.cfs_quota_us").read_text())
            period = int((cgroup_root / name / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        if quota > 0 and period > 0:
            return quota / period
    return None


def cgroup_cpu_quota(
    cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
    proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
) -> float | None:
    """This process's CPU quota in CPUs (cgroup v2 ``cpu.max``, else v1 CFS); None when unlimited."""
    root = Path(cgroup_root)
    rel = "/"
    try:
        for line in Path(proc_cgroup).read_text().splitlines():
            if line.startswith("0::"):
                rel = line[3:] or "/"
    except OSError:
        pass
    found = [q for q in (_quota_v2(root, rel), _quota_v1(root)) if q is not None]
    return min(found) if found else None


def available_cpus() -> int:
    """CPUs this process may use: affinity mask, capped by the cgroup quota (rounded down), >= 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        n = min(n, math.floor(quota))
    return max(1, n)


def default_threads() -> int:
    """``OMP_NUM_THREADS`` when set (torchrun sets 1 per rank when it starts several on one machine),
    else ``available_cpus()``."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return available_cpus()
    return n if n >= 1 else available_cpus()


def set_threads(threads: int | None = None) -> int:
    """Use ``threads`` torch threads (default ``default_threads()``); returns the number set."""
    import torch

    n = default_threads() if threads is None else threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"--threads={threads!r} must be an integer >= 1")
    torch.set_num_threads(n)
    return n


def add_threads_argument(
    p: argparse.ArgumentParser, *aliases: str, help: str | None = None
) -> None:
    """``--threads N`` (default: the CPUs available to this process, see ``available_cpus``)."""
    p.add_argument(
        "--threads",
        *aliases,
        dest="threads",
        type=int,
        default=None,
        metavar="N",
        help=help
        or "CPU threads (default: the CPUs available to this process: affinity and "
        "cgroup quota, not the machine's core count)",
    )
