"""The Slurm executor: each stage one ``sbatch`` job array, stages chained with ``--dependency=afterok``.

The shape of datatrove's ``SlurmPipelineExecutor``. For each stage with tasks left (no completion marker),
:class:`SlurmExecutor` writes under ``<output>/slurm/<stage>/<submission>/``:

- ``stage.pkl``: the stage's steps, its task count and the ranks still to run (pickled, as the local and
  Ray executors send a stage to their workers);
- ``job.sbatch``: an array script, one array task per range of ``tasks_per_job`` ranks
  (``#SBATCH --array=0-{n-1}%{workers}``), ``--dependency=afterok:<job of the stage before>`` and
  ``--kill-on-invalid-dep=yes`` (a stage whose predecessor failed is cancelled, not left pending);
  ``logs/%A_%a.out`` holds each array task's output;

and submits it with ``sbatch --parsable`` (the program is the ``sbatch`` argument: a path, or a name on
PATH). Each array task runs ``python -m lmstack.data.slurm task stage.pkl``: it reads its index from
``SLURM_ARRAY_TASK_ID`` and calls the same :func:`~lmstack.data.executor.run_task` as the other executors,
so outputs, stats and completion markers are identical, and a relaunch (the same command again) submits
only the tasks without a marker. An array task exits 1 when one of its ranks failed (its traceback in the
log), so ``afterok`` holds the next stage back.

A stage that starts with a reader whose input an earlier, still pending job writes cannot be split yet
(its task count is its file count): the executor then submits one small *continuation* job, after the last
array it submitted, that runs this executor again on the rest of the pipeline (``python -m
lmstack.data.slurm continue``) once those files exist. :meth:`SlurmExecutor.run` returns the job ids it
submitted and does not wait; ``lmstack data stats <output>`` reports when the jobs have finished.
Every path must be on storage that the compute nodes share (as for Ray on a cluster).
"""

from __future__ import annotations

import os
import pickle
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from lmstack.data.executor import _run_task_safely, plan_stage
from lmstack.data.pipeline import Pipeline, Stage
from lmstack.data.readers import Reader
from lmstack.utils import atomic_write_bytes, atomic_write_text


def _folder(output: str | os.PathLike, name: str) -> Path:
    """A new ``<output>/slurm/<name>/<NNN>/`` (one per submission: a relaunch never rewrites the pickle a
    queued job will read)."""
    base = Path(output) / "slurm" / name
    base.mkdir(parents=True, exist_ok=True)
    n = sum(1 for p in base.iterdir() if p.is_dir() and p.name.isdigit())
    folder = base / f"{n:03d}"
    (folder / "logs").mkdir(parents=True)
    return folder


class SlurmExecutor:
    """Stages as Slurm job arrays (see the module docstring).

    ``workers``: array tasks running at once per stage (``%N``; None: as many as Slurm schedules);
    ``tasks_per_job``: ranks per array task (run one after another); ``sbatch``: the submit program;
    ``partition``, ``time`` (``"4:00:00"``), ``mem`` (``"8G"``), ``cpus_per_task``: the usual ``#SBATCH``
    options (None leaves them to the cluster's defaults); ``sbatch_args``: more ``#SBATCH`` lines'
    options, e.g. ``["--account=lm", "--qos=low"]``; ``python``: the interpreter on the nodes;
    ``env``: variables exported in the script (OMP/MKL/OpenBLAS threads default to ``cpus_per_task``).
    """

    def __init__(
        self,
        workers: int | None = None,
        tasks_per_job: int = 1,
        sbatch: str = "sbatch",
        partition: str | None = None,
        time: str | None = None,
        mem: str | None = None,
        cpus_per_task: int = 1,
        sbatch_args: list[str] | tuple[str, ...] = (),
        python: str = sys.executable,
        job_name: str = "lmstack",
        env: dict[str, str] | None = None,
        progress: bool = True,
    ):
        for key, v, least in (
            ("workers", workers, 1),
            ("tasks_per_job", tasks_per_job, 1),
            ("cpus_per_task", cpus_per_task, 1),
        ):
            if v is None and key == "workers":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{key}={v!r} must be an integer >= {least}")
        if isinstance(sbatch_args, str):
            raise ValueError(f"sbatch_args={sbatch_args!r}: expected a list of options")
        self.workers, self.tasks_per_job, self.sbatch = workers, tasks_per_job, sbatch
        self.partition, self.time, self.mem, self.cpus_per_task = (
            partition,
            time,
            mem,
            cpus_per_task,
        )
        self.sbatch_args, self.python, self.job_name = list(sbatch_args), python, job_name
        self.env = {
            v: str(cpus_per_task)
            for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
        }
        self.env.update(env or {})
        self.progress = progress
        self.submitted: list[tuple[str, str]] = []  # (stage or "continue", job id), in order

    # ---- submitting -----------------------------------------------------------------------------------

    def run(self, pipeline: Pipeline, start: int = 0, after: str | None = None) -> list[str]:
        """Submit every stage from ``start`` with tasks left; the job ids, in submission order. ``after``:
        a job the first submission waits for (``afterok``)."""
        ids: list[str] = []
        dep = after
        for i in range(start, len(pipeline.stages)):
            stage = pipeline.stages[i]
            if dep is not None and isinstance(stage.steps[0], Reader):
                ids.append(self._submit_continuation(pipeline, i, dep))
                break
            world, pending = plan_stage(pipeline, stage)
            if not pending:
                continue
            dep = self._submit_stage(pipeline, stage, world, pending, dep)
            ids.append(dep)
        return ids

    def _header(self, name: str, folder: Path, dep: str | None, array: str | None) -> list[str]:
        opts = [f"--job-name={self.job_name}-{name}", f"--output={folder / 'logs'}/%A_%a.out"]
        if array is not None:
            opts.append(f"--array={array}")
        opts.append(f"--cpus-per-task={self.cpus_per_task}")
        opts += [f"--{k}={v}" for k, v in (("partition", self.partition), ("time", self.time),
                                            ("mem", self.mem)) if v is not None]  # fmt: skip
        if dep is not None:
            opts += [f"--dependency=afterok:{dep}", "--kill-on-invalid-dep=yes"]
        opts += self.sbatch_args
        lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in opts), "set -euo pipefail"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        return lines + [f"cd {shlex.quote(os.getcwd())}"]

    def _submit(self, script: Path, what: str) -> str:
        cmd = [self.sbatch, "--parsable", str(script)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as e:
            raise RuntimeError(f"{what}: cannot run {self.sbatch!r} ({e}); set sbatch=") from None
        job = done.stdout.strip().split(";")[0]  # --parsable: "jobid" or "jobid;cluster"
        if done.returncode != 0 or not job:
            raise RuntimeError(
                f"{what}: {shlex.join(cmd)} exited {done.returncode}: {done.stderr.strip()}"
            )
        self.submitted.append((what, job))
        if self.progress:
            print(f"submitted {what}: job {job} ({script})", file=sys.stderr)
        return job

    def _submit_stage(
        self, pipeline: Pipeline, stage: Stage, world: int, pending: list[int], dep: str | None
    ) -> str:
        folder = _folder(pipeline.output, stage.name)
        k = self.tasks_per_job
        jobs = (len(pending) + k - 1) // k
        task = {
            "stage": stage,
            "world": world,
            "ranks": [pending[j * k : (j + 1) * k] for j in range(jobs)],
            "output": pipeline.output,
            "exclusions": pipeline.exclusions,
        }
        atomic_write_bytes(folder / "stage.pkl", pickle.dumps(task))
        array = f"0-{jobs - 1}" + (f"%{self.workers}" if self.workers else "")
        lines = self._header(stage.name, folder, dep, array)
        lines.append(
            f"exec {shlex.quote(self.python)} -m lmstack.data.slurm task "
            f"{shlex.quote(str(folder / 'stage.pkl'))}"
        )
        atomic_write_text(folder / "job.sbatch", "\n".join(lines) + "\n")
        return self._submit(folder / "job.sbatch", f"stage {stage.name!r}")

    def _submit_continuation(self, pipeline: Pipeline, start: int, dep: str) -> str:
        name = pipeline.stages[start].name
        folder = _folder(pipeline.output, f"continue-{name}")
        atomic_write_bytes(folder / "pipeline.pkl", pickle.dumps((self, pipeline, start)))
        lines = self._header(f"continue-{name}", folder, dep, None)
        lines.append(
            f"exec {shlex.quote(self.python)} -m lmstack.data.slurm continue "
            f"{shlex.quote(str(folder / 'pipeline.pkl'))}"
        )
        atomic_write_text(folder / "job.sbatch", "\n".join(lines) + "\n")
        return self._submit(folder / "job.sbatch", f"continue from stage {name!r}")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "submitted": []}


# ---- what the jobs run ----------------------------------------------------------------------------------


def array_task(path: str | os.PathLike, index: int | None = None) -> int:
    """Run array task ``index`` (default ``$SLURM_ARRAY_TASK_ID``) of the stage pickled at ``path``;
    0 when every rank completed, else 1 (the tracebacks on stderr)."""
    if index is None:
        raw = os.environ.get("SLURM_ARRAY_TASK_ID")
        if raw is None or not raw.isdigit():
            raise RuntimeError(
                f"SLURM_ARRAY_TASK_ID={raw!r}: expected the array index (run by sbatch --array)"
            )
        index = int(raw)
    task = pickle.loads(Path(path).read_bytes())
    if not 0 <= index < len(task["ranks"]):
        raise ValueError(
            f"array index {index} out of range: {path} has {len(task['ranks'])} array tasks"
        )
    failed = 0
    for r in task["ranks"][index]:
        _, result, err = _run_task_safely(
            task["stage"], r, task["world"], task["output"], task["exclusions"]
        )
        state = "failed" if err else ("done" if result is not None else "already complete")
        print(f"stage {task['stage'].name!r} task {r} of {task['world']}: {state}", flush=True)
        if err:
            print(err, file=sys.stderr, flush=True)
            failed += 1
    return 1 if failed else 0


def continue_pipeline(path: str | os.PathLike) -> int:
    """The continuation job: submit the rest of a pipeline (its inputs now exist)."""
    executor, pipeline, start = pickle.loads(Path(path).read_bytes())
    ids = executor.run(pipeline, start)
    print(f"submitted jobs {ids}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "task":
        return array_task(argv[1])
    if len(argv) == 2 and argv[0] == "continue":
        return continue_pipeline(argv[1])
    print(
        "usage: python -m lmstack.data.slurm {task stage.pkl | continue pipeline.pkl}",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
