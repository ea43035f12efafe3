"""Checkpoints of a parallel run: per-rank shard files beside the gathered full weights.

Book of LLMs §1.8 (a checkpoint holds weights, optimizer states and everything the run depends on)
and §6.4 (under ZeRO each rank holds only its 1/M of the optimizer states — so each rank saves
its own piece; gathering them on one rank would need the memory ZeRO saved). Layout, beside the
single-process checkpoint ``lmstack.train.checkpoint`` writes:

    step_N/                    written by rank 0 through lmstack.train.checkpoint:
        model.safetensors      the FULL parameters gathered from every shard, single-process names
                               (export, evaluation, inference; a fresh run with any plan can start
                               from them)
        state.json, rng.safetensors   step, config, schedule, tokens seen; rank 0's RNG states
    step_N.shards/
        plan.json              the plan, world size and layout (mesh sizes, zero, backend) of the shards
        rank_<r>.safetensors   rank r's parameters as it holds them (``ParallelModel.local_state_dict``:
                               ZeRO-3 flat shards, tp/pp pieces, native DTensors' local pieces), its
                               optimizer states (ZeRO-1/2 shards, ZeroRedundancyOptimizer's local
                               optimizer), its torch RNG and data-sampler generator (seeded per dp rank)
        rank_<r>.json          the optimizer's hyper-parameters and scalar states, python/numpy RNG
    Without ZeRO the data-parallel (and context-parallel) replicas hold the same parameters and
    optimizer states: only the dp = cp = 0 rank of each (tp, pp) position writes them, the others
    write their RNG states and name that rank in ``state_from`` (``replica_source``). With expert
    parallelism the ranks of one ep group hold different experts: the dp = e (e < ep) rank writes
    the state of ep coordinate e, and so each expert shard is saved once.

Resuming reads every rank's own file, so it needs the same layout — world size, mesh sizes, zero
stage, backend (checked against ``plan.json``); settings that do not move state between ranks
(bucket size, ddp mode, micro-batches) may change. To change the layout, start a fresh run from
``model.safetensors``.

Atomic: every rank writes its files (each through ``atomic_path``) into a hidden staging folder;
after a barrier rank 0 renames it to ``step_N.shards`` and only then writes ``step_N`` (itself
atomic, and the ``latest`` pointer after it). A crash at any point leaves ``latest`` on the
previous complete pair; shard folders whose ``step_N`` is gone (pruned by ``keep_last`` or never
committed) are removed. The folder must be on a file system every node sees (multi-node runs).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from lmstack.run_state import (
    CheckpointError,
    capture_rng,
    commit_dir,
    join_optimizer,
    restore_rng,
    split_optimizer,
)
from lmstack.utils import atomic_path, atomic_write_text

SHARD_FORMAT = "lmstack-parallel-shards-v1"


def shards_dir(step_dir: str | os.PathLike) -> Path:
    """``<dir>/step_N`` -> ``<dir>/step_N.shards``."""
    p = Path(step_dir)
    return p.parent / f"{p.name}.shards"


def _local_optimizer(optimizer):
    """The optimizer whose states live on this rank: ZeroRedundancyOptimizer keeps a local one."""
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # pragma: no cover
        return optimizer
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _params_in_order(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _rank_files(folder: Path, rank: int) -> tuple[Path, Path]:
    return folder / f"rank_{rank:05d}.safetensors", folder / f"rank_{rank:05d}.json"


def replica_source(pm, rank: int) -> int:
    """The rank whose parameters and optimizer states this rank's equal: without ZeRO every
    data-parallel (and context-parallel) replica holds the same ones as its dp = cp = 0 peer,
    so only that peer writes them; otherwise the rank itself."""
    if pm.plan.zero != 0:
        return rank
    c = pm.mesh.coords(rank)
    ep = getattr(
        pm.mesh, "ep", 1
    )  # expert parallelism: the replicas of one expert shard (same dp mod ep)
    return pm.mesh.rank_of(pp=c["pp"], dp=c["dp"] % ep, cp=0, tp=c["tp"])


def _write_rank(folder: Path, rank: int, pm, optimizer, data_generator) -> None:
    tensors: dict[str, torch.Tensor] = {}
    source = replica_source(pm, rank)
    if source != rank:  # a replica: only its RNG states are its own
        optimizer = None
    else:
        for k, v in pm.local_state_dict().items():
            tensors[f"model/{k}"] = v
    opt_meta = None
    if optimizer is not None:
        sd = _local_optimizer(optimizer).state_dict()
        opt_tensors, opt_meta = split_optimizer(sd)
        for k, v in opt_tensors.items():
            tensors[f"optim/{k}"] = v.to_local() if hasattr(v, "to_local") else v
    rng_tensors, rng_meta = capture_rng(data_generator)
    for k, v in rng_tensors.items():
        tensors[f"rng/{k}"] = v
    # clones: safetensors refuses tensors that share storage (tied weights, ZeRO views)
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}
    st_path, js_path = _rank_files(folder, rank)
    with atomic_path(st_path) as tmp:
        save_file(tensors, str(tmp))
    atomic_write_text(
        js_path,
        json.dumps(
            {
                "format": SHARD_FORMAT,
                "rank": rank,
                "state_from": source,
                "optimizer": opt_meta,
                "rng": rng_meta,
            }
        ),
    )


def _layout(pm) -> dict[str, Any]:
    """What decides how the state is split over the ranks (bucket sizes, ddp mode, micro-batches do not)."""
    out = {a: pm.mesh.size(a) for a in ("dp", "tp", "pp", "cp")}
    if getattr(pm.mesh, "ep", 1) > 1:  # (absent for ep = 1: earlier checkpoints keep resuming)
        out["ep"] = pm.mesh.ep
    out.update(zero=pm.plan.zero, backend=pm.plan.backend, world_size=dist.get_world_size())
    if pm.mesh.pp > 1:
        out["schedule_zb"] = pm.plan.schedule == "zb"  # the zero-bubble split renames the linears
    return out


def _plan_record(pm) -> dict[str, Any]:
    return {
        "format": SHARD_FORMAT,
        "plan": asdict(pm.plan),
        "world_size": dist.get_world_size(),
        "layout": _layout(pm),
    }


def save_sharded(
    directory: str | os.PathLike,
    step: int,
    pm,
    optimizer,
    data_generator,
    write_main: Callable[[], Path],
) -> Path | None:
    """Every rank: write this rank's shard of step ``step``; rank 0 then commits the shard folder
    and calls ``write_main()`` (the single-process checkpoint with the gathered weights).
    Returns ``write_main``'s path on rank 0, None elsewhere. A collective (barriers)."""
    d = Path(directory)
    rank = dist.get_rank()
    staging = d / f".staging_step_{step:08d}.shards"
    if rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    dist.barrier()
    _write_rank(staging, rank, pm, optimizer, data_generator)
    if rank == 0:
        atomic_write_text(staging / "plan.json", json.dumps(_plan_record(pm), indent=1))
    dist.barrier()
    path = None
    if rank == 0:
        old = commit_dir(staging, d / f"step_{step:08d}.shards", d / f".old_step_{step:08d}.shards")
        path = write_main()
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        for sh in d.glob("step_*.shards"):  # shards of pruned (or never committed) checkpoints
            if not (d / sh.name[: -len(".shards")]).is_dir():
                shutil.rmtree(sh, ignore_errors=True)
    dist.barrier()
    return path


def load_sharded(step_dir: str | os.PathLike, pm, optimizer, data_generator) -> dict[str, Any]:
    """Every rank: restore its parameters, optimizer states and RNG states from its shard file
    of checkpoint ``step_dir``; returns the checkpoint's ``state.json``."""
    p = Path(step_dir)
    folder = shards_dir(p)
    if not (p / "state.json").is_file():
        raise CheckpointError(f"{p}: not a checkpoint (no state.json)")
    if not (folder / "plan.json").is_file():
        raise CheckpointError(
            f"{p}: no per-rank shards ({folder.name}/plan.json) to resume a parallel run from; "
            f"start a fresh run from {p / 'model.safetensors'} instead"
        )
    rec = json.loads((folder / "plan.json").read_text())
    want = _layout(pm)
    if rec.get("layout") != want:
        raise CheckpointError(
            f"{p}: its shards were saved with the layout {rec.get('layout')} (plan "
            f"{rec.get('plan')}), but this run has {want}; resume with the same plan and world "
            f"size, or start a fresh run from {p / 'model.safetensors'}"
        )
    rank = dist.get_rank()
    st_path, js_path = _rank_files(folder, rank)
    if not st_path.is_file() or not js_path.is_file():
        raise CheckpointError(f"{folder}: missing the files of rank {rank}")
    own = load_file(str(st_path))
    meta = json.loads(js_path.read_text())
    tensors = own
    source = meta.get("state_from", rank)
    if source != rank:  # a data-parallel replica: parameters and optimizer states from its source
        src_st, src_js = _rank_files(folder, source)
        if not src_st.is_file() or not src_js.is_file():
            raise CheckpointError(
                f"{folder}: missing the files of rank {source} (rank {rank}'s state)"
            )
        tensors = load_file(str(src_st))
        meta = {**meta, "optimizer": json.loads(src_js.read_text()).get("optimizer")}
    pm.load_local_state_dict(
        {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}
    )
    if optimizer is not None:
        if meta.get("optimizer") is None:
            raise CheckpointError(f"{st_path}: no optimizer state to resume from")
        local = _local_optimizer(optimizer)
        sd = join_optimizer(
            {k[len("optim/") :]: v for k, v in tensors.items() if k.startswith("optim/")},
            meta["optimizer"],
        )
        params = _params_in_order(local)
        for idx, st in sd["state"].items():
            q = params[idx]
            for k, v in list(st.items()):
                if not isinstance(v, torch.Tensor) or k == "step":
                    continue
                if hasattr(q, "to_local") and tuple(v.shape) == tuple(
                    q.to_local().shape
                ):  # native DTensor
                    from torch.distributed.tensor import DTensor

                    v = DTensor.from_local(
                        v.to(q.device),
                        q.device_mesh,
                        q.placements,
                        shape=q.shape,
                        stride=q.stride(),
                        run_check=False,
                    )
                st[k] = v.to(q.device) if not hasattr(v, "to_local") else v
        local.load_state_dict(sd)
        if hasattr(
            optimizer, "refresh_shards"
        ):  # ZeRO-1/2: shards that are copies follow the params
            optimizer.refresh_shards()
    restore_rng(
        {k[len("rng/") :]: v for k, v in own.items() if k.startswith("rng/")},
        meta.get("rng", {}),
        data_generator,
    )
    return json.loads((p / "state.json").read_text())
