"""The Slurm executor without a cluster: a fake ``sbatch`` on PATH runs each array task here (with
SLURM_ARRAY_TASK_ID set) and honours ``--dependency=afterok``; the outputs must equal the local executor's,
a relaunch after a failed task submits only the tasks without a completion marker, and the script carries
the options Slurm reads."""

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from lmstack.data.executor import LocalExecutor
from lmstack.data.pipeline import Pipeline
from lmstack.data.slurm import SlurmExecutor, array_task

REPO = Path(__file__).resolve().parents[2]

# Reads the #SBATCH lines of the script, as sbatch does; runs array tasks 0..N-1 one after another; a job
# whose afterok dependency did not succeed is cancelled (what --kill-on-invalid-dep=yes does); prints the id.
FAKE_SBATCH = textwrap.dedent("""\
    #!{python}
    import json, os, re, subprocess, sys
    from pathlib import Path
    state = Path(os.environ["FAKE_SLURM_STATE"])
    jobs = json.loads(state.read_text()) if state.exists() else []
    args = sys.argv[1:]
    assert args[0] == "--parsable", args
    script = Path(args[1])
    opts = dict(re.match(r"#SBATCH --([\\w-]+)=?(.*)", ln).groups()
                for ln in script.read_text().splitlines() if ln.startswith("#SBATCH "))
    job = str(1000 + len(jobs))
    rec = {{"id": job, "script": str(script), "opts": opts, "state": "COMPLETED"}}
    jobs.append(rec)
    state.write_text(json.dumps(jobs))
    dep = opts.get("dependency")
    if dep:
        kind, _, ids = dep.partition(":")
        assert kind == "afterok", dep
        done = {{j["id"]: j["state"] for j in json.loads(state.read_text())}}
        if any(done.get(i) != "COMPLETED" for i in ids.split(":")):
            rec["state"] = "CANCELLED"
    if rec["state"] != "CANCELLED":
        array = opts.get("array", "0-0").split("%")[0]
        lo, hi = map(int, array.split("-"))
        for i in range(lo, hi + 1):
            log = opts["output"].replace("%A", job).replace("%a", str(i))
            env = dict(os.environ, SLURM_ARRAY_TASK_ID=str(i), SLURM_ARRAY_JOB_ID=job)
            with open(log, "w") as f:
                rc = subprocess.run(["bash", str(script)], env=env, stdout=f, stderr=f).returncode
            if rc:
                rec["state"] = "FAILED"
    jobs = json.loads(state.read_text())
    jobs[[j["id"] for j in jobs].index(job)]["state"] = rec["state"]
    state.write_text(json.dumps(jobs))
    print(job)
""")

STEP_MODULE = '''
import os
from lmstack.data.step import Filter, Step

class Log(Step):
    """Appends "start <rank>" to ``log`` when a task starts; fails task ``fail_rank`` while ``flag`` exists."""
    def __init__(self, log, flag="", fail_rank=-1):
        self.log, self.flag, self.fail_rank = log, flag, fail_rank
    def run(self, docs, stats):
        with open(self.log, "a") as f:
            f.write(f"start {self.name} {self.rank}\\n")
        if self.rank == self.fail_rank and os.path.exists(self.flag):
            raise RuntimeError("the flag says fail")
        for d in docs:
            stats.seen(d)
            stats.kept(d)
            yield d

class NoDrop(Filter):
    def reason(self, doc):
        return "contains_drop" if "drop" in doc.text else None
'''


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """4 JSONL files of 5 records (records 0 and 3 say "drop"), a fake sbatch in bin/ on PATH."""
    (tmp_path / "slurm_stepmod.py").write_text(STEP_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(tmp_path), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "sbatch"
    fake.write_text(FAKE_SBATCH.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_STATE", str(tmp_path / "slurm_state.json"))
    inp = tmp_path / "in"
    inp.mkdir()
    for i in range(4):
        lines = [
            json.dumps({"text": f"file {i} doc {j}" + (" drop" if j in (0, 3) else "")})
            for j in range(5)
        ]
        (inp / f"part{i}.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def pipeline(root: Path, out: str, fail_rank: int = -1) -> Pipeline:
    """filter (one task per file) -> a global stage of 2 tasks -> a stage that reads the filter's shards."""
    o = root / out
    log = {"type": "slurm_stepmod:Log", "log": str(root / f"{out}.log")}
    return Pipeline.from_dict(
        {
            "output": str(o),
            "stage": [
                {
                    "name": "filter",
                    "step": [
                        {"type": "read_jsonl", "paths": [str(root / "in")]},
                        {"type": "slurm_stepmod:NoDrop"},
                        {**log, "flag": str(root / "flag"), "fail_rank": fail_rank},
                        {"type": "write_jsonl", "output": str(o / "clean")},
                    ],
                },
                {"name": "middle", "tasks": 2, "step": [{**log, "name": "middle"}]},
                {
                    "name": "final",
                    "step": [
                        {"type": "read_jsonl", "paths": [str(o / "clean")]},
                        {"type": "write_jsonl", "output": str(o / "out"), "compression": None},
                    ],
                },
            ],
        }
    )


def tree(folder: Path) -> dict[str, bytes]:
    """Outputs, stats and exclusions below ``folder`` (not the markers: they hold the wall time)."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        and p.name != "config.json"  # the stage's configuration: it holds the run's own paths
        and not {"completions", "slurm"} & set(p.relative_to(folder).parts)
    }


def jobs(root: Path) -> list[dict]:
    return json.loads((root / "slurm_state.json").read_text())


@pytest.mark.slow
def test_slurm_outputs_equal_the_local_executor(corpus):
    LocalExecutor(1, progress=False).run(pipeline(corpus, "local"))
    ex = SlurmExecutor(workers=3, tasks_per_job=3, progress=False, partition="cpu", time="1:00:00")
    ids = ex.run(pipeline(corpus, "slurm"))
    local, slurm = tree(corpus / "local"), tree(corpus / "slurm")
    assert local == slurm and "out/00000_00000.jsonl" in local  # hand count below
    assert sum(len(b.splitlines()) for k, b in slurm.items() if k.startswith("out/")) == 12
    # filter (array of 2: ranks 0-2 and 3), middle, then a continuation that submitted final
    js = jobs(corpus)
    assert [j["state"] for j in js] == ["COMPLETED"] * 4 and ids == ["1000", "1001", "1002"]
    filt, middle, cont, final = (j["opts"] for j in js)
    assert filt["array"] == "0-1%3" and "dependency" not in filt
    assert filt["partition"] == "cpu" and filt["time"] == "1:00:00"
    assert middle["array"] == "0-0%3" and middle["dependency"] == "afterok:1000"
    assert "array" not in cont and cont["dependency"] == "afterok:1001"
    assert (
        final["array"] == "0-1%3" and "dependency" not in final
    )  # submitted after middle finished
    starts = (corpus / "slurm.log").read_text().split("\n")
    assert sorted(filter(None, starts)) == sorted(
        [f"start log {r}" for r in range(4)] + [f"start middle {r}" for r in range(2)]
    )
    # the array task reads SLURM_ARRAY_TASK_ID; a relaunch of a finished pipeline submits nothing
    assert SlurmExecutor(progress=False).run(pipeline(corpus, "slurm")) == []
    assert len(jobs(corpus)) == 4


@pytest.mark.slow
def test_a_failed_task_holds_back_later_stages_and_a_relaunch_runs_only_it(corpus):
    (corpus / "flag").write_text("")
    LocalExecutor(1, progress=False).run(pipeline(corpus, "local", fail_rank=-1))
    ex = SlurmExecutor(progress=False)
    ex.run(pipeline(corpus, "slurm", fail_rank=2))
    assert [j["state"] for j in jobs(corpus)] == ["FAILED", "CANCELLED", "CANCELLED"]
    marks = sorted(os.listdir(corpus / "slurm" / "filter" / "completions"))
    assert marks == ["00000.json", "00001.json", "00003.json"]
    assert not (corpus / "slurm" / "middle" / "completions").exists()
    log = next((corpus / "slurm" / "slurm" / "filter" / "000" / "logs").glob("1000_2.out"))
    assert "the flag says fail" in log.read_text()
    (corpus / "flag").unlink()
    ex.run(pipeline(corpus, "slurm", fail_rank=2))
    relaunch = jobs(corpus)[3:]
    assert [j["state"] for j in relaunch] == ["COMPLETED"] * 4
    assert relaunch[0]["opts"]["array"] == "0-0"  # only rank 2 was left
    starts = [
        s for s in (corpus / "slurm.log").read_text().split("\n") if s.startswith("start log")
    ]
    assert sorted(starts) == [
        "start log 0",
        "start log 1",
        "start log 2",
        "start log 2",
        "start log 3",
    ]
    assert tree(corpus / "local") == tree(corpus / "slurm")


@pytest.mark.slow
def test_script_options_and_errors(corpus, monkeypatch):
    p = pipeline(corpus, "s")
    ex = SlurmExecutor(
        sbatch=str(corpus / "bin" / "sbatch"),
        mem="4G",
        cpus_per_task=2,
        sbatch_args=["--account=lm", "--qos=low"],
        progress=False,
    )
    ex.run(p)
    script = (corpus / "s" / "slurm" / "filter" / "000" / "job.sbatch").read_text()
    for line in ("#SBATCH --array=0-3", "#SBATCH --mem=4G", "#SBATCH --cpus-per-task=2",
                 "#SBATCH --account=lm", "#SBATCH --qos=low", "export OMP_NUM_THREADS=2"):  # fmt: skip
        assert line in script.splitlines()
    assert script.startswith("#!/bin/bash\n") and "-m lmstack.data.slurm task" in script
    with pytest.raises(RuntimeError, match="cannot run"):
        SlurmExecutor(sbatch=str(corpus / "no-sbatch"), progress=False).run(pipeline(corpus, "t"))
    (corpus / "bin" / "false-sbatch").write_text("#!/bin/sh\necho 'bad partition' >&2\nexit 1\n")
    (corpus / "bin" / "false-sbatch").chmod(0o755)
    with pytest.raises(RuntimeError, match="exited 1: bad partition"):
        SlurmExecutor(sbatch="false-sbatch", progress=False).run(pipeline(corpus, "u"))
    with pytest.raises(ValueError, match="tasks_per_job=0"):
        SlurmExecutor(tasks_per_job=0)
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    with pytest.raises(RuntimeError, match="SLURM_ARRAY_TASK_ID"):
        array_task(corpus / "s" / "slurm" / "filter" / "000" / "stage.pkl")
    with pytest.raises(ValueError, match="out of range"):
        array_task(corpus / "s" / "slurm" / "filter" / "000" / "stage.pkl", 4)


@pytest.mark.slow
def test_cli_submits_to_slurm(corpus, capsys):
    from lmstack.cli import main

    path = corpus / "p.toml"
    path.write_text(
        f'output = "{corpus / "c"}"\n[[step]]\ntype = "read_jsonl"\npaths = ["{corpus / "in"}"]\n'
        f'[[step]]\ntype = "write_jsonl"\noutput = "{corpus / "c" / "docs"}"\n'
    )
    args = ["data", "run", str(path), "--executor", "slurm", "--no-progress", "--workers", "2"]
    assert main(args + ["--sbatch-arg=--qos=low", "--tasks-per-job", "2"]) == 0
    assert (
        "submitted Slurm jobs 1000; when they finish: lmstack data stats" in capsys.readouterr().out
    )
    assert jobs(corpus)[0]["opts"]["array"] == "0-1%2" and jobs(corpus)[0]["opts"]["qos"] == "low"
    assert len(os.listdir(corpus / "c" / "main" / "completions")) == 4
    assert main(args) == 0 and "(none: every task has completed)" in capsys.readouterr().out
