"""Run several ``lmstack train`` jobs one after another in ONE torchrun launch:

    torchrun --nproc_per_node=N tests/parallel/parallel_train_driver.py jobs.json

``jobs.json`` is a list of ``{"name", "dir", "args", "may_fail"}``; each job is
``lmstack.cli.main(["train", *args])`` — the function ``python -m lmstack train`` calls — so it
goes through the same argument parsing, config loading, Trainer, plan and export as the command.
The first job initialises the process group (as the command does) and later jobs reuse it: each
job builds its own mesh groups, so nothing of one plan is shared with the next; a barrier between
jobs keeps the ranks on the same job. A launch costs
seconds of start-up (torch imported by torchrun and by every rank); sharing one launch among the
plans of one world size is what keeps tests/parallel/test_parallel_trainer.py short.

Per job and rank, ``dir/rank<r>.log`` gets the job's stdout/stderr (a traceback on an exception)
and ``dir/rank<r>.rc`` its exit code. A job that fails (unless ``may_fail``) ends the launch
(torchrun stops the other ranks, which could otherwise wait in a collective of that job), so
the jobs after it have no ``.rc`` file: the test names the job that stopped the launch.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path


def main(jobs_path: str) -> int:
    import torch.distributed as dist

    from lmstack.cli import main as lmstack_main

    rank = int(os.environ["RANK"])
    for job in json.loads(Path(jobs_path).read_text()):
        if (
            dist.is_initialized()
        ):  # every rank has finished (and recorded) the job before: a failure in
            dist.barrier()  # this one cannot stop a rank still writing the last one's files
        d = Path(job["dir"])
        d.mkdir(parents=True, exist_ok=True)
        log = d / f"rank{rank}.log"
        with (
            open(log, "w", encoding="utf-8", buffering=1) as f,
            contextlib.redirect_stdout(f),
            contextlib.redirect_stderr(f),
        ):
            try:
                rc = lmstack_main(["train", *job["args"]])
            except SystemExit as e:  # argparse errors
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - recorded in the job's log, then the launch ends
                traceback.print_exc()
                rc = 1
        (d / f"rank{rank}.rc").write_text(str(rc))
        if rc != 0 and not job.get("may_fail"):
            print(
                f"parallel_train_driver: job {job['name']} failed on rank {rank} (exit code {rc}); see {log}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(
                1
            )  # no clean-up: the other ranks may be blocked in one of this job's collectives
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: torchrun --nproc_per_node=N parallel_train_driver.py jobs.json")
    sys.exit(main(sys.argv[1]))
