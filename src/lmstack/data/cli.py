"""``lmstack data``: ``run`` (a pipeline TOML, local, on Ray or on Slurm, resumable) and ``stats`` (the merged report
and funnel PNG of a run). Other data commands live in their own modules, listed in :data:`SUBCOMMANDS`:
each defines ``register(sub)`` and adds its parsers to the ``lmstack data`` subparsers it is given.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from lmstack.data.executor import StageFailed, get_executor
from lmstack.data.pipeline import Pipeline
from lmstack.data.report import format_table, merge_stats, plot_funnel, to_json
from lmstack.utils import atomic_write_text

# modules adding `lmstack data ...` subcommands (demo, train-classifier, ...), each with register(sub): add yours
SUBCOMMANDS: tuple[str, ...] = ("lmstack.data.cli_filters",)  # train-classifier, demo


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "data", help="pretraining data: readers, filters, dedup, tokenize, on one machine or Ray"
    )
    sub = p.add_subparsers(title="data commands", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda a: (p.print_help(), 0)[1])

    r = sub.add_parser(
        "run", help="run a pipeline TOML (relaunching resumes: completed tasks are skipped)"
    )
    r.add_argument("pipeline", help="pipeline TOML file (docs/data.md)")
    r.add_argument(
        "--executor",
        choices=["local", "ray", "slurm"],
        default="local",
        help="local processes (default), Ray, or Slurm job arrays (submits and returns)",
    )
    r.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tasks at once (local default 1: in this process; ray default: as many as Ray schedules)",
    )
    r.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to join ('auto', 'ray://host:10001'); default: start a local Ray",
    )
    r.add_argument("--sbatch", default="sbatch", help="slurm: the submit program (path or name)")
    r.add_argument("--partition", default=None, help="slurm: #SBATCH --partition")
    r.add_argument(
        "--time", default=None, help="slurm: #SBATCH --time per array task, e.g. 4:00:00"
    )
    r.add_argument("--mem", default=None, help="slurm: #SBATCH --mem, e.g. 8G")
    r.add_argument(
        "--tasks-per-job", type=int, default=1, help="slurm: pipeline tasks per array task"
    )
    r.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        help="slurm: another #SBATCH option, e.g. --sbatch-arg=--account=lm (repeatable)",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser(
        "stats", help="merge a run's task stats: a table, stats.json and a funnel PNG"
    )
    s.add_argument("dir", help="the pipeline's output folder")
    s.add_argument("--png", default=None, help="funnel PNG path (default DIR/funnel.png)")
    s.set_defaults(func=cmd_stats)

    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)


def cmd_run(args) -> int:
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers={args.workers} must be >= 1")
    pipeline = Pipeline.from_toml(args.pipeline)
    kw = {"progress": not args.no_progress}
    if args.executor == "ray":
        kw["address"] = args.ray_address
    if args.executor == "slurm":
        kw.update(sbatch=args.sbatch, partition=args.partition, time=args.time, mem=args.mem)
        kw.update(tasks_per_job=args.tasks_per_job, sbatch_args=args.sbatch_arg)
    try:
        jobs = get_executor(args.executor, args.workers, **kw).run(pipeline)
    except StageFailed as e:
        print(f"lmstack: error: {e}", file=sys.stderr)
        return 1
    if args.executor == "slurm":
        print(
            f"submitted Slurm jobs {', '.join(jobs) or '(none: every task has completed)'}; "
            f"when they finish: lmstack data stats {pipeline.output}"
        )
        return 0
    _report(Path(pipeline.output), None)
    return 0


def cmd_stats(args) -> int:
    _report(Path(args.dir), args.png)
    return 0


def _report(output: Path, png: str | None) -> None:
    merged = merge_stats(output)
    print(format_table(merged))
    atomic_write_text(output / "stats.json", json.dumps(to_json(merged), indent=1) + "\n")
    path = plot_funnel(merged, png or output / "funnel.png")
    print(f"wrote {output / 'stats.json'} and {path}")
