"""Running a pipeline: every stage as independent tasks, locally (processes) or on Ray; resumable.

One task (:func:`run_task`) chains its stage's steps (each ``step.for_task(rank, world)``), drains the chain,
then writes, in this order and each atomically, under ``<output>/<stage>/``:

- its outputs (the writer steps' shards) and ``excluded/{rank:05d}.jsonl.gz`` (dropped documents, with
  step and reason, when the pipeline keeps exclusions);
- ``stats/{rank:05d}.json``: per step, documents and bytes in and out, drops per reason, counters;
- ``completions/{rank:05d}.json``: the completion marker (with the task's wall time).

Before a stage's tasks run, ``<stage>/config.json`` records its steps' configuration (it holds the run's
absolute paths, so two runs into different folders differ only there, in the markers and in the logs).

A relaunch skips every task with a marker and reruns the others from the start (a task's writer first
deletes that task's unfinished files), so the outputs are byte-identical to an uninterrupted run and no
completed task runs twice — datatrove's contract. ``tasks.json`` records each stage's task count; a relaunch
with a different count is refused (the markers would belong to another split), and ``<stage>/config.json``
records the stage's step configuration (:func:`~lmstack.data.step.step_config`): a relaunch with another step list
or another value is refused too (the completed tasks' outputs came from the old one). Stages run in order, each
after every task of the one before has completed (the barrier multi-stage work such as dedup needs).

Executors: :class:`LocalExecutor` (``workers`` processes, default 1 = in this process; tqdm bar of tasks),
:class:`RayExecutor` (the same :func:`run_task` as a Ray task, one CPU each, at most ``workers`` in
flight; on a cluster every path must be on storage all nodes share) and, in :mod:`lmstack.data.slurm`,
``SlurmExecutor`` (each stage an sbatch job array, stages chained by ``--dependency=afterok``). A failed task leaves no marker: the
stage's other tasks finish, then the run stops with an error naming the failed tasks.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from lmstack.data.pipeline import Pipeline, Stage
from lmstack.data.readers import Reader
from lmstack.data.step import StepStats, step_config
from lmstack.data.writers import ExclusionWriter, clear_task_files
from lmstack.utils import atomic_write_text


def _logs(output: str | os.PathLike, stage: str) -> Path:
    return Path(output) / stage


def marker_path(output: str | os.PathLike, stage: str, rank: int) -> Path:
    return _logs(output, stage) / "completions" / f"{rank:05d}.json"


def step_names(stage: Stage) -> list[str]:
    """The stage's step names, made unique by a ``_2``, ``_3`` suffix (stats are merged by name)."""
    seen: dict[str, int] = {}
    out = []
    for s in stage.steps:
        seen[s.name] = seen.get(s.name, 0) + 1
        out.append(s.name if seen[s.name] == 1 else f"{s.name}_{seen[s.name]}")
    return out


def run_task(
    stage: Stage,
    rank: int,
    world: int,
    output: str,
    exclusions: bool = True,
    progress: bool = False,
) -> dict[str, Any] | None:
    """Run task ``rank`` of ``world`` of ``stage``; its stats dict, or None when it had already completed.
    ``progress``: a tqdm bar of the documents leaving the last step."""
    marker = marker_path(output, stage.name, rank)
    if marker.exists():
        return None
    t0 = time.perf_counter()
    logs = _logs(output, stage.name)
    for folder in ("stats", "completions"):  # temp files of a run killed while writing them
        clear_task_files(logs / folder, f"{rank:05d}.")
    steps = [s.for_task(rank, world) for s in stage.steps]
    stats = [StepStats(n) for n in step_names(stage)]
    excluded = ExclusionWriter(logs / "excluded", rank) if exclusions else None
    for st in stats:
        st.on_drop = excluded
    gens = []
    docs: Any = iter(())
    for step, st in zip(steps, stats):
        docs = step.run(docs, st)
        gens.append(docs)
    try:
        if progress:
            from tqdm import tqdm

            docs = tqdm(
                docs, desc=f"{stage.name} task {rank}", unit="doc", leave=False, file=sys.stderr
            )
        for _ in docs:
            pass
    except BaseException:
        for g in reversed(gens):
            g.close()
        if excluded is not None:
            excluded.abort()
        raise
    if excluded is not None:
        excluded.close()
    result = {
        "stage": stage.name,
        "rank": rank,
        "world": world,
        "steps": [st.to_dict() for st in stats],
    }
    atomic_write_text(logs / "stats" / f"{rank:05d}.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(
        marker, json.dumps({"rank": rank, "seconds": round(time.perf_counter() - t0, 3)}) + "\n"
    )
    return result


def _run_task_safely(
    stage: Stage, rank: int, world: int, output: str, exclusions: bool, progress: bool = False
):
    """run_task, with a failure returned as text (an exception from a worker may not unpickle)."""
    try:
        return rank, run_task(stage, rank, world, output, exclusions, progress), None
    except Exception:
        return rank, None, traceback.format_exc()


def plan_stage(pipeline: Pipeline, stage: Stage) -> tuple[int, list[int]]:
    """(task count, ranks still to run); records the count in ``tasks.json`` or checks it against it."""
    if isinstance(stage.steps[0], Reader):
        stage.steps[0].files()  # list the inputs now, once, for every task
    world = stage.task_count()
    record = Path(pipeline.output) / "tasks.json"
    counts = json.loads(record.read_text()) if record.exists() else {}
    if counts.get(stage.name, world) != world:
        raise ValueError(
            f"stage {stage.name!r} was launched with {counts[stage.name]} tasks in {pipeline.output}, "
            f"now {world}: its completion markers belong to that split (keep the inputs and tasks, or "
            "use a new output folder)"
        )
    if stage.name not in counts:
        counts[stage.name] = world
        atomic_write_text(record, json.dumps(counts, indent=1) + "\n")
    _check_config(pipeline, stage)
    return world, [
        r for r in range(world) if not marker_path(pipeline.output, stage.name, r).exists()
    ]


def _config_with_inputs(step) -> dict[str, Any]:
    """step_config, plus a reader's input files with their sizes (a crawl rewritten with other pages, or a
    file added, is another input: the completed tasks read the old one)."""
    config = step_config(step)
    if isinstance(step, Reader):
        config["input_files"] = [[src, path.stat().st_size] for src, path in step.files()]
    return config


def _check_config(pipeline: Pipeline, stage: Stage) -> None:
    """Records the stage's step configuration (``<stage>/config.json``); a relaunch with other steps or other
    values (a changed threshold) is refused: the completed tasks' outputs came from the old ones."""
    record = _logs(pipeline.output, stage.name) / "config.json"
    # through JSON, so tuples and lists compare equal
    now = json.loads(json.dumps([_config_with_inputs(s) for s in stage.steps]))
    before = json.loads(record.read_text()) if record.exists() else None
    if before is None:
        atomic_write_text(record, json.dumps(now, indent=1) + "\n")
        return
    if before == now:
        return
    if [s.get("type") for s in before] != [s.get("type") for s in now]:
        what = f"steps {[s.get('name') for s in before]} then, now {[s.get('name') for s in now]}"
    else:
        diffs = []
        for old, new in zip(before, now):
            for key in sorted(set(old) | set(new)):
                if old.get(key) != new.get(key):
                    a, b = (repr(x)[:60] for x in (old.get(key), new.get(key)))
                    diffs.append(f"{new.get('name')}.{key}: {a} then, {b} now")
        what = "; ".join(diffs)
    raise ValueError(
        f"stage {stage.name!r} in {pipeline.output} was launched with another configuration ({what}): its "
        "completed tasks' outputs came from that one; use a new output folder, or delete this one to rerun"
    )


class StageFailed(RuntimeError):
    pass


def _raise_failures(stage: Stage, failures: dict[int, str]) -> None:
    if failures:
        first = min(failures)
        raise StageFailed(
            f"stage {stage.name!r}: {len(failures)} task(s) failed ({sorted(failures)}); the "
            f"completed ones keep their markers, rerun to retry. Task {first}:\n{failures[first]}"
        )


def _bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="task", disable=not progress, file=sys.stderr)


def _one_thread_each() -> None:
    """Worker start-up: one BLAS/OpenMP thread per worker process (the workers share the CPUs)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")


class LocalExecutor:
    """Tasks in ``workers`` processes (``spawn``: no state inherited from the caller); 1 runs them here."""

    def __init__(self, workers: int = 1, progress: bool = True, start_method: str = "spawn"):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers={workers!r} must be an integer >= 1")
        self.workers, self.progress, self.start_method = workers, progress, start_method

    def run(self, pipeline: Pipeline) -> None:
        for stage in pipeline.stages:
            world, pending = plan_stage(pipeline, stage)
            failures: dict[int, str] = {}
            with _bar(world, stage.name, self.progress) as bar:
                bar.update(world - len(pending))
                if self.workers == 1 or len(pending) <= 1:
                    for r in pending:
                        _, _, err = _run_task_safely(
                            stage, r, world, pipeline.output, pipeline.exclusions, self.progress
                        )
                        if err:
                            failures[r] = err
                        bar.update()
                else:
                    import multiprocessing as mp
                    from concurrent.futures import ProcessPoolExecutor, as_completed

                    ctx = mp.get_context(self.start_method)
                    with ProcessPoolExecutor(
                        min(self.workers, len(pending)),
                        mp_context=ctx,
                        initializer=_one_thread_each,
                    ) as pool:
                        futs = [
                            pool.submit(
                                _run_task_safely,
                                stage,
                                r,
                                world,
                                pipeline.output,
                                pipeline.exclusions,
                            )
                            for r in pending
                        ]
                        for f in as_completed(futs):
                            r, _, err = f.result()
                            if err:
                                failures[r] = err
                            bar.update()
            _raise_failures(stage, failures)


class RayExecutor:
    """Tasks as Ray tasks (one CPU each, at most ``workers`` in flight; None: as many as Ray schedules).

    Uses this process's Ray when ``ray.init`` already ran; else joins ``address`` (``"auto"``: the cluster
    ``ray start`` began on this machine, ``"ray://head:10001"``: a remote one) or, with None, starts a new
    local Ray bound to 127.0.0.1 without a dashboard and with usage statistics off
    (``RAY_USAGE_STATS_ENABLED=0`` unless set; ``ray_init``: more ``ray.init`` keyword arguments),
    and shuts down what it started after the run.
    """

    def __init__(
        self,
        workers: int | None = None,
        address: str | None = None,
        progress: bool = True,
        ray_init: dict[str, Any] | None = None,
    ):
        if workers is not None and (
            isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
        ):
            raise ValueError(f"workers={workers!r} must be an integer >= 1 or None")
        self.workers, self.address, self.progress, self.ray_init = (
            workers,
            address,
            progress,
            ray_init or {},
        )

    def run(self, pipeline: Pipeline) -> None:
        try:
            import ray
        except ImportError:
            raise ImportError(
                "the Ray executor needs ray: pip install 'lmstack[data-ray]'"
            ) from None
        started = not ray.is_initialized()
        if started:
            if self.address is None:  # a local Ray of our own sends no usage statistics anywhere
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            local = {
                "address": "local",
                "include_dashboard": False,
                "_node_ip_address": "127.0.0.1",
            }
            ray.init(
                **(local if self.address is None else {"address": self.address}), **self.ray_init
            )
        try:
            remote = ray.remote(num_cpus=1)(_run_task_safely)
            for stage in pipeline.stages:
                world, pending = plan_stage(pipeline, stage)
                failures: dict[int, str] = {}
                limit = self.workers or len(pending) or 1
                queue, in_flight, rank_of = list(pending), [], {}
                with _bar(world, stage.name, self.progress) as bar:
                    bar.update(world - len(pending))
                    while queue or in_flight:
                        while queue and len(in_flight) < limit:
                            r = queue.pop(0)
                            ref = remote.remote(
                                stage, r, world, pipeline.output, pipeline.exclusions
                            )
                            rank_of[ref] = r
                            in_flight.append(ref)
                        done, in_flight = ray.wait(in_flight, num_returns=1)
                        for ref in done:
                            try:
                                r, _, err = ray.get(ref)
                            except Exception as e:  # the worker died (ray.exceptions.RayTaskError / WorkerCrashedError)
                                r, err = rank_of[ref], f"{type(e).__name__}: {e}"
                            if err:
                                failures[r] = err
                            bar.update()
                _raise_failures(stage, failures)
        finally:
            if started:
                ray.shutdown()


def get_executor(name: str = "local", workers: int | None = None, **kw):
    """``local`` (:class:`LocalExecutor`), ``ray`` (:class:`RayExecutor`) or ``slurm``
    (:class:`~lmstack.data.slurm.SlurmExecutor`: submits job arrays and returns without waiting)."""
    if name == "local":
        return LocalExecutor(workers or 1, **kw)
    if name == "ray":
        return RayExecutor(workers, **kw)
    if name == "slurm":
        from lmstack.data.slurm import SlurmExecutor

        return SlurmExecutor(workers, **kw)
    raise ValueError(f"executor {name!r}: expected 'local', 'ray' or 'slurm'")
