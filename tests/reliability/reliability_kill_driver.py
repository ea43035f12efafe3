"""Run ``lmstack train`` and SIGKILL this process at a named dangerous point of checkpointing.

    python reliability_kill_driver.py POINT STEP -- <lmstack train arguments>

POINT (the kill happens while saving checkpoint step STEP):
  after_rename  the new step folder is renamed into place, ``latest`` not yet rewritten
  mid_prune     pruning has renamed an old checkpoint away and deleted one of its files
  mid_resave    a re-save of step STEP has moved the old folder aside, the new one not renamed in
  none          no fault (a plain run through this driver)

The patches live only in this test driver: lmstack itself has no fault-injection code.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, step: int) -> None:
    from lmstack.train import checkpoint as ckpt

    name = f"step_{step:08d}"
    if point == "after_rename":
        real_write = ckpt.atomic_write_text

        def write(path, text):
            if Path(path).name == "latest" and text.strip() == name:
                die()
            real_write(path, text)

        ckpt.atomic_write_text = write
    elif point == "mid_prune":
        real_rmtree = shutil.rmtree

        def rmtree(path, *a, **kw):
            p = Path(path)
            if (p.name.startswith(".pruned_") or p.name.startswith("step_")) and (
                Path(p.parent) / "latest"
            ).read_text().strip() == name:
                files = sorted(f for f in p.rglob("*") if f.is_file())
                if files:
                    files[0].unlink()  # part of the folder is gone
                die()
            real_rmtree(path, *a, **kw)

        ckpt.shutil.rmtree = rmtree
    elif point == "mid_resave":
        real_rename = os.rename

        def rename(src, dst):
            real_rename(src, dst)
            if Path(src).name == name and Path(dst).name.startswith(f".old_{name}"):
                die()

        ckpt.os.rename = rename
    elif point != "none":
        raise SystemExit(f"unknown fault point {point!r}")


if __name__ == "__main__":
    point, step, sep, *rest = sys.argv[1:]
    assert sep == "--"
    install(point, int(step))
    from lmstack.cli import main

    sys.exit(main(["train", *rest]))
