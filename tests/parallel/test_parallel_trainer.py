"""The launch item end to end: ``torchrun --nproc_per_node=2 -m lmstack train --config run.toml``
with the plan as a TOML table (``parallel = {dp = 2, zero = 1}``, ``{dp = 2}``, ``{tp = 2}``, and
``{dp = 2, tp = 2, zero = 1}`` on 4 ranks) trains
through the trainer and matches the single-process trainer on the same global batch.

The reference is the plain single-process ``Trainer`` (no lmstack.parallel involved): for dp = 2
its micro-batch is the two ranks' micro-batches concatenated (each rank's sampler is seeded by its
dp rank), for tp = 2 both ranks read the same rows (dp rank 0), so the reference reads them too.
Clipping is active (grad_clip below the norm) and weight decay is on, so the sharded gradient
norm and the optimizer's decay groups are checked too; the final checkpoint (full parameters
gathered from the shards, written by rank 0) must equal the reference's weights.

Launches: torch's import makes every torchrun launch cost seconds per rank on a small machine,
so one plan per world size (``CLI_PLANS``) runs as its own ``torchrun -m lmstack train --config``
launch and the other plans of that world size run one after another in a single torchrun launch
of ``parallel_train_driver.py``, which calls the same ``lmstack.cli.main(["train", ...])`` per plan
(the resumed halves of the resume tests get a launch of their own: a fresh process, as after a
kill). The single-process reference runs once per distinct (config, dp) and is shared by the plans
that need it. Each plan is still its own test and a failure names it (see ``Launches.result``)."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

MODEL = {
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "d_ff": 64,
    "vocab_size": 64,
    "max_seq_len": 64,
    "attn_backend": "sdpa",
    "norm_backend": "torch",
    "tie_embeddings": True,
}
DRIVER = Path(__file__).with_name("parallel_train_driver.py")


def _toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _write_toml(path: Path, cfg: dict) -> None:
    lines = [f"{k} = {_toml_value(v)}" for k, v in cfg.items() if k != "model"]
    lines.append("[model]")
    lines += [f"{k} = {_toml_value(v)}" for k, v in cfg["model"].items()]
    path.write_text("\n".join(lines) + "\n")


def _data(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    ids = np.tile(np.arange(1, 33), 200)[:6000]
    ids = np.where(rng.random(ids.shape) < 0.1, rng.integers(1, 64, size=ids.shape), ids).astype(
        np.uint16
    )
    data = tmp_path / "tokens.bin"
    ids.tofile(data)
    (tmp_path / "tokens.bin.json").write_text(
        json.dumps({"n_tokens": len(ids), "dtype": "uint16", "vocab_size": 64})
    )
    return data


def _reference(cfg: dict, dp: int):
    """Single-process trainer; its micro-batch = the dp ranks' micro-batches concatenated.
    Returns its train rows, eval rows and final weights."""
    from lmstack.train.config import TrainConfig
    from lmstack.train.data import Batch, get_batch
    from lmstack.train.trainer import Trainer

    class Concat(Trainer):
        def __init__(self, c):
            super().__init__(c, progress=False)
            self.gens = [torch.Generator().manual_seed(c.seed * 1_000_003 + r) for r in range(dp)]

        def next_batch(self):
            c = self.config
            parts = [
                get_batch(self.train_tokens, c.batch_size, c.seq_len, self.device, g)
                for g in self.gens
            ]
            return Batch(torch.cat([b.x for b in parts]), torch.cat([b.y for b in parts]))

    c = TrainConfig.from_dict({**cfg, "parallel": None})
    t = Concat(c)
    t.fit()
    sd = {k: v.detach().clone() for k, v in t.raw_model.state_dict().items()}
    return _rows(Path(c.out_dir)), _rows(Path(c.out_dir), "eval"), sd


PLANS = [  # (plan, dp, grad_accum, nproc, id)
    ({"dp": 2, "zero": 1}, 2, 2, 2, "dp2_zero1_accum2"),
    ({"dp": 2}, 2, 2, 2, "ddp2_no_sync_accum2"),
    ({"tp": 2}, 1, 1, 2, "tp2"),
    ({"dp": 2, "zero": 3}, 2, 2, 2, "dp2_zero3_accum2"),
    ({"pp": 2, "schedule": "1f1b"}, 1, 2, 2, "pp2_1f1b_m2"),
    ({"pp": 2, "schedule": "zb"}, 1, 4, 2, "pp2_zb_m4"),
    ({"cp": 2}, 1, 2, 2, "cp2_accum2"),
    ({"dp": 2, "backend": "native"}, 2, 2, 2, "native_ddp2_accum2"),
    ({"dp": 2, "zero": 1, "backend": "native"}, 2, 1, 2, "native_dp2_zero1"),
    ({"dp": 2, "zero": 3, "backend": "native"}, 2, 2, 2, "native_dp2_zero3_accum2"),
    ({"tp": 2, "backend": "native"}, 1, 1, 2, "native_tp2"),
    ({"pp": 2, "schedule": "gpipe", "backend": "native"}, 1, 2, 2, "native_pp2_gpipe_m2"),
    ({"dp": 2, "tp": 2, "zero": 1}, 2, 1, 4, "dp2_tp2_zero1_4ranks"),
    ({"dp": 2, "tp": 2, "zero": 3}, 2, 2, 4, "dp2_tp2_zero3_4ranks"),
    ({"dp": 2, "pp": 2}, 2, 2, 4, "dp2_pp2_4ranks"),
    ({"tp": 2, "pp": 2}, 1, 2, 4, "tp2_pp2_4ranks"),
    ({"dp": 2, "cp": 2, "zero": 2}, 2, 1, 4, "dp2_cp2_zero2_4ranks"),
    ({"dp": 2, "tp": 2, "pp": 2, "zero": 1}, 2, 2, 8, "dp2_tp2_pp2_zero1_8ranks"),  # 3-D
]
# one plan per world size runs as its own `torchrun -m lmstack train --config run.toml` launch
CLI_PLANS = ("dp2_zero1_accum2", "dp2_tp2_zero1_4ranks", "dp2_tp2_pp2_zero1_8ranks")

RESUME = [
    ({"dp": 2}, 1, "ddp2"),
    ({"dp": 2, "zero": 2}, 2, "dp2_zero2"),
    ({"dp": 2, "zero": 3}, 2, "dp2_zero3"),
    ({"tp": 2}, 1, "tp2"),
    ({"pp": 2}, 2, "pp2"),
    ({"dp": 2, "zero": 3, "backend": "native"}, 2, "native_dp2_zero3"),
]


def _config(job_dir: Path, data: Path, plan, accum: int, **kw) -> dict:
    return {
        "train_data": str(data),
        "batch_size": 2,
        "seq_len": 16,
        "grad_accum": accum,
        "max_steps": 4,
        "warmup_steps": 0,
        "lr": 1e-2,
        "min_lr": 1e-3,
        "eps": 1e-6,
        "weight_decay": 0.1,
        "grad_clip": 0.5,
        "eval_interval": 0,
        "eval_batches": 1,
        "log_interval": 1,
        "out_dir": str(job_dir / "run"),
        "device": "cpu",
        "precision": "fp32",
        "parallel": plan,
        "model": MODEL,
        **kw,
    }


def _rows(run_dir: Path, kind: str = "train") -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in rows if x["kind"] == kind]


def _checkpoint_weights(run_dir: Path) -> dict:
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(ckpt / "model.safetensors"))


# ---- launches ------------------------------------------------------------------------------


@dataclass
class Job:
    """One ``lmstack train`` run: ``launch`` names the torchrun launch it runs in (``cli_*``: its
    own ``torchrun -m lmstack train``; ``driver_*``: shared, through parallel_train_driver.py)."""

    name: str
    launch: str
    nproc: int
    cfg: dict
    extra: tuple = ()
    needs: str | None = None  # a job whose output this one reads (resume from its checkpoint)
    may_fail: bool = False  # the test checks its error; kept last in its launch

    @property
    def dir(self) -> Path:
        return Path(self.cfg["out_dir"]).parent

    @property
    def config_path(self) -> Path:
        return self.dir / f"{Path(self.cfg['out_dir']).name}.toml"

    @property
    def log_dir(self) -> Path:  # the driver's per-rank logs and exit codes
        return self.dir / f"{Path(self.cfg['out_dir']).name}_logs"

    @property
    def args(self) -> list[str]:
        return ["--config", str(self.config_path), "--no-progress", *self.extra]


@dataclass
class JobResult:
    rcs: list  # exit code per rank; None where the rank never finished the job
    output: str  # the job's logs (or the launch's output) for failure messages

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.rcs)


def _jobs(base: Path, data: Path) -> dict[str, Job]:
    jobs = {}
    for plan, _dp, accum, nproc, pid in PLANS:
        launch = f"cli_{pid}" if pid in CLI_PLANS else f"driver_{nproc}ranks"
        jobs[pid] = Job(pid, launch, nproc, _config(base / pid, data, plan, accum))
    later = []
    for plan, accum, rid in RESUME:
        name = f"resume_{rid}"
        cfg = _config(base / name, data, plan, accum, max_steps=6, ckpt_interval=3, keep_last=5)
        jobs[name] = Job(name, "driver_2ranks", 2, cfg)
        resume = ("--resume", str(Path(cfg["out_dir"]) / "checkpoints" / "step_00000003"))
        cfg2 = {**cfg, "out_dir": str(base / name / "resumed")}
        jobs[f"{name}_resumed"] = Job(
            f"{name}_resumed", "driver_2ranks_resume", 2, cfg2, resume, needs=name
        )
        if plan.get("zero") == 2:  # another plan cannot read these shards: a clear error
            cfg3 = {**cfg2, "out_dir": str(base / name / "other"), "parallel": {"dp": 2, "zero": 1}}
            later.append(
                Job(
                    f"{name}_other_plan",
                    "driver_2ranks_resume",
                    2,
                    cfg3,
                    resume,
                    needs=name,
                    may_fail=True,
                )
            )
    jobs.update((j.name, j) for j in later)
    return jobs


def _tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


class Launches:
    """Runs each launch once, when a test first asks for one of its jobs, with only the jobs of
    the selected tests (``-k`` picks one plan: its launch runs that plan alone)."""

    def __init__(self, base: Path, needed: set[str] | None):
        self.base = base
        self.data = _data(base)
        self.jobs = _jobs(base, self.data)
        if needed is not None:
            needed = {n for n in self.jobs if n in needed}
            needed |= {self.jobs[n].needs for n in needed if self.jobs[n].needs}
        self.needed = needed if needed else set(self.jobs)
        self.done: dict[str, subprocess.CompletedProcess] = {}

    def _run(self, launch: str) -> subprocess.CompletedProcess:
        if launch in self.done:
            return self.done[launch]
        jobs = [j for j in self.jobs.values() if j.launch == launch and j.name in self.needed]
        for j in jobs:
            j.dir.mkdir(parents=True, exist_ok=True)
            _write_toml(j.config_path, j.cfg)
        if launch.startswith("cli_"):
            (job,) = jobs
            target, timeout = ["-m", "lmstack", "train", *job.args], 300
        else:
            spec = [
                {"name": j.name, "dir": str(j.log_dir), "args": j.args, "may_fail": j.may_fail}
                for j in jobs
            ]
            (self.base / f"{launch}.json").write_text(json.dumps(spec, indent=1))
            target, timeout = [str(DRIVER), str(self.base / f"{launch}.json")], 120 + 60 * len(jobs)
        torchrun = Path(sys.executable).with_name("torchrun")
        # --standalone: torchrun's rendezvous store binds port 0 itself (no free port picked beforehand,
        # which another concurrent gloo job could take before torchrun binds it)
        cmd = [str(torchrun), "--standalone", f"--nproc_per_node={jobs[0].nproc}", *target]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            r = subprocess.run(
                cmd, cwd=self.base, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as e:
            out = "".join(
                x.decode(errors="replace") if isinstance(x, bytes) else x
                for x in (e.stdout, e.stderr)
                if x
            )
            r = subprocess.CompletedProcess(cmd, f"timed out after {timeout}s", out, "")
        self.done[launch] = r
        return r

    def result(self, name: str) -> JobResult:
        job = self.jobs[name]
        if job.needs:
            self.ok(job.needs)
        self._run(job.launch)
        return self._read(job)

    def _read(self, job: Job) -> JobResult:
        r = self.done[job.launch]
        launch_out = f"--- torchrun ({job.launch}) exit code {r.returncode} ---\n" + _tail(
            r.stdout + r.stderr
        )
        if job.launch.startswith("cli_"):
            return JobResult([r.returncode] * job.nproc, launch_out)
        rcs, logs = [], []
        for rank in range(job.nproc):
            rc = job.log_dir / f"rank{rank}.rc"
            rcs.append(int(rc.read_text()) if rc.is_file() else None)
            log = job.log_dir / f"rank{rank}.log"
            if log.is_file():
                logs.append(f"--- rank {rank} log ---\n" + _tail(log.read_text()))
        return JobResult(rcs, "\n".join(logs) + "\n" + launch_out)

    def ok(self, name: str) -> Path:
        """The job's run directory; fails naming the job (and the job that stopped its launch)."""
        res = self.result(name)
        if not res.ok:
            job = self.jobs[name]
            msg = f"job {name} (plan {job.cfg['parallel']}, launch {job.launch}) exit codes per rank {res.rcs}"
            if all(rc is None for rc in res.rcs):
                first = next(
                    (
                        j.name
                        for j in self.jobs.values()
                        if j.launch == job.launch
                        and j.name in self.needed
                        and not j.may_fail
                        and not self._read(j).ok
                    ),
                    "?",
                )
                msg += (
                    ": it did not finish (killed, or the launch timed out)"
                    if first == name
                    else f": not run, the launch stopped at job {first} (its test shows why)"
                )
            pytest.fail(msg + "\n" + res.output, pytrace=False)
        return Path(self.jobs[name].cfg["out_dir"])


def _needed_jobs(items) -> set[str] | None:
    """The job names the selected tests of this module use (None: unknown, run them all)."""
    out = set()
    for item in items:
        if item.module.__name__ != __name__ or not hasattr(item, "callspec"):
            continue
        if item.originalname == "test_torchrun_plan_table_matches_single_process_trainer":
            out.add(item.callspec.id)
        elif item.originalname == "test_torchrun_resume_from_sharded_checkpoint_continues_the_run":
            out |= {
                f"resume_{item.callspec.id}",
                f"resume_{item.callspec.id}_resumed",
                f"resume_{item.callspec.id}_other_plan",
            }
    return out or None


@pytest.fixture(scope="module")
def launches(tmp_path_factory, request):
    return Launches(
        tmp_path_factory.mktemp("parallel_trainer"), _needed_jobs(request.session.items)
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(cfg, dp)``: ``_reference`` run once per distinct (config, dp)."""
    base, cache = tmp_path_factory.mktemp("parallel_trainer_ref"), {}

    def get(cfg: dict, dp: int):
        key = (json.dumps({**cfg, "out_dir": None, "parallel": None}, sort_keys=True), dp)
        if key not in cache:
            cache[key] = _reference({**cfg, "out_dir": str(base / f"ref_{len(cache)}")}, dp)
        return cache[key]

    return get


# ---- tests ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("plan,dp,accum,nproc", [x[:4] for x in PLANS], ids=[x[4] for x in PLANS])
def test_torchrun_plan_table_matches_single_process_trainer(
    launches, reference, request, plan, dp, accum, nproc
):
    name = request.node.callspec.id
    cfg = launches.jobs[name].cfg
    assert (cfg["parallel"], cfg["grad_accum"], launches.jobs[name].nproc) == (plan, accum, nproc)
    run = launches.ok(name)
    train = _rows(run)
    ref_rows, ref_ev, ref_sd = reference(cfg, dp)
    assert [x["step"] for x in train] == [x["step"] for x in ref_rows] == [1, 2, 3, 4]
    losses, ref_losses = [x["loss"] for x in train], [x["loss"] for x in ref_rows]
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    np.testing.assert_allclose(
        [x["grad_norm"] for x in train], [x["grad_norm"] for x in ref_rows], rtol=1e-4
    )
    assert all(x["grad_norm"] > cfg["grad_clip"] for x in ref_rows[:2])  # clipping was active
    assert (
        train[0]["tokens"] == 2 * accum * 16 * dp
    )  # tokens per step count replicas, not tp/pp/cp ranks
    # the final evaluation runs through the plan's forward (pp: stage by stage; cp: gathered logits)
    ev = _rows(run, "eval")
    np.testing.assert_allclose(
        [x["val_loss"] for x in ev], [x["val_loss"] for x in ref_ev], rtol=0, atol=1e-5
    )
    # the checkpoint holds the full (gathered) parameters under single-process names
    sd = _checkpoint_weights(run)
    assert set(sd) <= set(ref_sd) and set(ref_sd) - set(sd) <= {"lm_head.weight", "unembed.weight"}
    for k, v in sd.items():
        torch.testing.assert_close(v, ref_sd[k], rtol=0, atol=1e-4, msg=k)
    exported = load_file(str(run / "model" / "model.safetensors"))  # rank 0's export: full weights
    assert set(exported) == set(sd)
    for k, v in exported.items():
        torch.testing.assert_close(v, ref_sd[k], rtol=0, atol=1e-4, msg=k)
    print(f"{plan}: losses {losses} vs single-process {ref_losses}")


@pytest.mark.slow
@pytest.mark.parametrize("plan,accum", [x[:2] for x in RESUME], ids=[x[2] for x in RESUME])
def test_torchrun_resume_from_sharded_checkpoint_continues_the_run(launches, request, plan, accum):
    """A run checkpoints at step 3 (per-rank shards: optimizer states as sharded) and goes on to
    step 6; a second torchrun resumed from the step-3 checkpoint — as after a kill — must log the
    same losses for steps 4-6 and end on the same weights."""
    from lmstack.parallel.checkpoint import shards_dir

    name = f"resume_{request.node.callspec.id}"
    assert (launches.jobs[name].cfg["parallel"], launches.jobs[name].cfg["grad_accum"]) == (
        plan,
        accum,
    )
    run = launches.ok(name)
    step3 = run / "checkpoints" / "step_00000003"
    shards = shards_dir(step3)
    assert sorted(x.name for x in shards.iterdir()) == [
        "plan.json",
        "rank_00000.json",
        "rank_00000.safetensors",
        "rank_00001.json",
        "rank_00001.safetensors",
    ]
    assert not list((run / "checkpoints").glob(".staging*"))
    rank1 = load_file(str(shards / "rank_00001.safetensors"))
    if plan == {
        "dp": 2
    }:  # a DDP replica writes only its RNG states; its parameters come from rank 0's file
        assert rank1 and all(k.startswith("rng/") for k in rank1)
    else:
        assert any(k.startswith("optim/") for k in rank1)
    full = _rows(run)
    assert [x["step"] for x in full] == [1, 2, 3, 4, 5, 6]
    assert launches.jobs[f"{name}_resumed"].extra == ("--resume", str(step3))
    resumed_dir = launches.ok(f"{name}_resumed")  # a fresh torchrun launch, as after a kill
    resumed = _rows(resumed_dir)
    assert [x["step"] for x in resumed] == [4, 5, 6]
    np.testing.assert_allclose(
        [x["loss"] for x in resumed], [x["loss"] for x in full[3:]], rtol=0, atol=1e-6
    )
    np.testing.assert_allclose(
        [x["grad_norm"] for x in resumed], [x["grad_norm"] for x in full[3:]], rtol=1e-5
    )
    a, b = _checkpoint_weights(run), _checkpoint_weights(resumed_dir)
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    if plan.get("zero") == 2:  # another plan cannot read these shards: a clear error
        other = f"{name}_other_plan"
        assert launches.jobs[other].cfg["parallel"] == {"dp": 2, "zero": 1}
        res = launches.result(other)
        assert (
            all(rc not in (0, None) for rc in res.rcs) and "resume with the same plan" in res.output
        ), res.output


def test_config_parallel_accepts_a_table_or_string_and_names_bad_values(tmp_path):
    from lmstack.train.config import TrainConfig, TrainConfigError

    data = _data(tmp_path)
    cfg = {"train_data": str(data), "parallel": {"dp": 2, "tp": 2, "zero": 1}, "model": MODEL}
    _write_toml(tmp_path / "run.toml", cfg)
    assert TrainConfig.load(tmp_path / "run.toml").parallel == {"dp": 2, "tp": 2, "zero": 1}
    assert (
        TrainConfig.load(tmp_path / "run.toml", ["parallel=dp=2,zero=2"]).parallel == "dp=2,zero=2"
    )
    with pytest.raises(TrainConfigError, match="unknown key 'dq'"):
        TrainConfig(train_data=str(data), parallel={"dq": 2})
    with pytest.raises(TrainConfigError, match="parallel=3 must be a table"):
        TrainConfig(train_data=str(data), parallel=3)
    with pytest.raises(TrainConfigError, match="zero=7"):
        TrainConfig(train_data=str(data), parallel="zero=7")
