"""The launch item end to end: ``torchrun --nproc_per_node=2 -m lmstack train --config run.toml``
with the plan as a TOML table (``parallel = {dp = 2, zero = 1}``, ``{dp = 2}``, ``{tp = 2}``, and
``{dp = 2, tp = 2, zero = 1}`` on 4 ranks) trains
through the trainer and matches the single-process trainer on the same global batch.

The reference is the plain single-process ``Trainer`` (no lmstack.parallel involved): for dp = 2
its micro-batch is the two ranks' micro-batches concatenated (each rank's sampler is seeded by its
dp rank), for tp = 2 both ranks read the same rows (dp rank 0), so the reference reads them too.
Clipping is active (grad_clip below the norm) and weight decay is on, so the sharded gradient
norm and the optimizer's decay groups are checked too; the final checkpoint (full parameters
gathered from the shards, written by rank 0) must equal the reference's weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from parallel_helpers import free_port

MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64, "vocab_size": 64,
         "max_seq_len": 64, "attn_backend": "sdpa", "norm_backend": "torch", "tie_embeddings": True}


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
    ids = np.where(rng.random(ids.shape) < 0.1, rng.integers(1, 64, size=ids.shape), ids).astype(np.uint16)
    data = tmp_path / "tokens.bin"
    ids.tofile(data)
    (tmp_path / "tokens.bin.json").write_text(json.dumps({"n_tokens": len(ids), "dtype": "uint16",
                                                          "vocab_size": 64}))
    return data


def _reference(cfg: dict, dp: int):
    """Single-process trainer; its micro-batch = the dp ranks' micro-batches concatenated."""
    from lmstack.train.config import TrainConfig
    from lmstack.train.data import Batch, get_batch
    from lmstack.train.trainer import Trainer

    class Concat(Trainer):
        def __init__(self, c):
            super().__init__(c, progress=False)
            self.gens = [torch.Generator().manual_seed(c.seed * 1_000_003 + r) for r in range(dp)]

        def next_batch(self):
            c = self.config
            parts = [get_batch(self.train_tokens, c.batch_size, c.seq_len, self.device, g) for g in self.gens]
            return Batch(torch.cat([b.x for b in parts]), torch.cat([b.y for b in parts]))

    c = TrainConfig.from_dict({**cfg, "parallel": None, "out_dir": cfg["out_dir"] + "_ref"})
    t = Concat(c)
    t.fit()
    rows = [json.loads(x) for x in Path(c.out_dir, "metrics.jsonl").read_text().splitlines()]
    sd = {k: v.detach().clone() for k, v in t.raw_model.state_dict().items()}
    return [r for r in rows if r["kind"] == "train"], sd


def _launch(tmp_path: Path, cfg: dict, nproc: int = 2, extra: list[str] = ()) -> subprocess.CompletedProcess:
    _write_toml(tmp_path / "run.toml", cfg)
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nnodes=1", "--node_rank=0", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "lmstack", "train", "--config", str(tmp_path / "run.toml"),
           "--no-progress", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


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


def _config(tmp_path: Path, plan, accum: int, **kw) -> dict:
    data = _data(tmp_path)
    return {"train_data": str(data), "batch_size": 2, "seq_len": 16, "grad_accum": accum, "max_steps": 4,
            "warmup_steps": 0, "lr": 1e-2, "min_lr": 1e-3, "eps": 1e-6, "weight_decay": 0.1, "grad_clip": 0.5,
            "eval_interval": 0, "eval_batches": 1, "log_interval": 1, "out_dir": str(tmp_path / "run"),
            "device": "cpu", "precision": "fp32", "parallel": plan, "model": MODEL, **kw}


def _rows(run_dir: Path, kind: str = "train") -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in rows if x["kind"] == kind]


def _checkpoint_weights(run_dir: Path) -> dict:
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(ckpt / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("plan,dp,accum,nproc", [x[:4] for x in PLANS], ids=[x[4] for x in PLANS])
def test_torchrun_plan_table_matches_single_process_trainer(tmp_path, plan, dp, accum, nproc):
    cfg = _config(tmp_path, plan, accum)
    r = _launch(tmp_path, cfg, nproc)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    train = _rows(tmp_path / "run")
    ref_rows, ref_sd = _reference(cfg, dp)
    assert [x["step"] for x in train] == [x["step"] for x in ref_rows] == [1, 2, 3, 4]
    losses, ref_losses = [x["loss"] for x in train], [x["loss"] for x in ref_rows]
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    np.testing.assert_allclose([x["grad_norm"] for x in train], [x["grad_norm"] for x in ref_rows], rtol=1e-4)
    assert all(x["grad_norm"] > cfg["grad_clip"] for x in ref_rows[:2])  # clipping was active
    assert train[0]["tokens"] == 2 * accum * 16 * dp  # tokens per step count replicas, not tp/pp/cp ranks
    # the final evaluation runs through the plan's forward (pp: stage by stage; cp: gathered logits)
    ev, ref_ev = _rows(tmp_path / "run", "eval"), _rows(Path(cfg["out_dir"] + "_ref"), "eval")
    np.testing.assert_allclose([x["val_loss"] for x in ev], [x["val_loss"] for x in ref_ev], rtol=0, atol=1e-5)
    # the checkpoint holds the full (gathered) parameters under single-process names
    sd = _checkpoint_weights(tmp_path / "run")
    assert set(sd) <= set(ref_sd) and set(ref_sd) - set(sd) <= {"lm_head.weight", "unembed.weight"}
    for k, v in sd.items():
        torch.testing.assert_close(v, ref_sd[k], rtol=0, atol=1e-4, msg=k)
    exported = load_file(str(tmp_path / "run" / "model" / "model.safetensors"))  # rank 0's export: full weights
    assert set(exported) == set(sd)
    for k, v in exported.items():
        torch.testing.assert_close(v, ref_sd[k], rtol=0, atol=1e-4, msg=k)
    print(f"{plan}: losses {losses} vs single-process {ref_losses}")


RESUME = [({"dp": 2}, 1, "ddp2"), ({"dp": 2, "zero": 2}, 2, "dp2_zero2"), ({"dp": 2, "zero": 3}, 2, "dp2_zero3"),
          ({"tp": 2}, 1, "tp2"), ({"pp": 2}, 2, "pp2"), ({"dp": 2, "zero": 3, "backend": "native"}, 2, "native_dp2_zero3")]


@pytest.mark.slow
@pytest.mark.parametrize("plan,accum", [x[:2] for x in RESUME], ids=[x[2] for x in RESUME])
def test_torchrun_resume_from_sharded_checkpoint_continues_the_run(tmp_path, plan, accum):
    """A run checkpoints at step 3 (per-rank shards: optimizer states as sharded) and goes on to
    step 6; a second torchrun resumed from the step-3 checkpoint — as after a kill — must log the
    same losses for steps 4-6 and end on the same weights."""
    from lmstack.parallel.checkpoint import shards_dir

    cfg = _config(tmp_path, plan, accum, max_steps=6, ckpt_interval=3, keep_last=5)
    r = _launch(tmp_path, cfg, 2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    step3 = tmp_path / "run" / "checkpoints" / "step_00000003"
    shards = shards_dir(step3)
    assert sorted(x.name for x in shards.iterdir()) == ["plan.json", "rank_00000.json", "rank_00000.safetensors",
                                                        "rank_00001.json", "rank_00001.safetensors"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".staging*"))
    rank1 = load_file(str(shards / "rank_00001.safetensors"))
    if plan == {"dp": 2}:  # a DDP replica writes only its RNG states; its parameters come from rank 0's file
        assert rank1 and all(k.startswith("rng/") for k in rank1)
    else:
        assert any(k.startswith("optim/") for k in rank1)
    full = _rows(tmp_path / "run")
    cfg2 = {**cfg, "out_dir": str(tmp_path / "resumed")}
    r = _launch(tmp_path, cfg2, 2, extra=["--resume", str(step3)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    resumed = _rows(tmp_path / "resumed")
    assert [x["step"] for x in resumed] == [4, 5, 6]
    np.testing.assert_allclose([x["loss"] for x in resumed], [x["loss"] for x in full[3:]], rtol=0, atol=1e-6)
    np.testing.assert_allclose([x["grad_norm"] for x in resumed], [x["grad_norm"] for x in full[3:]], rtol=1e-5)
    a, b = _checkpoint_weights(tmp_path / "run"), _checkpoint_weights(tmp_path / "resumed")
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    if plan.get("zero") == 2:  # another plan cannot read these shards: a clear error
        r = _launch(tmp_path, {**cfg2, "out_dir": str(tmp_path / "other"), "parallel": {"dp": 2, "zero": 1}}, 2,
                    extra=["--resume", str(step3)])
        assert r.returncode != 0 and "resume with the same plan" in r.stdout + r.stderr


def test_config_parallel_accepts_a_table_or_string_and_names_bad_values(tmp_path):
    from lmstack.train.config import TrainConfig, TrainConfigError

    data = _data(tmp_path)
    cfg = {"train_data": str(data), "parallel": {"dp": 2, "tp": 2, "zero": 1}, "model": MODEL}
    _write_toml(tmp_path / "run.toml", cfg)
    assert TrainConfig.load(tmp_path / "run.toml").parallel == {"dp": 2, "tp": 2, "zero": 1}
    assert TrainConfig.load(tmp_path / "run.toml", ["parallel=dp=2,zero=2"]).parallel == "dp=2,zero=2"
    with pytest.raises(TrainConfigError, match="unknown key 'dq'"):
        TrainConfig(train_data=str(data), parallel={"dq": 2})
    with pytest.raises(TrainConfigError, match="parallel=3 must be a table"):
        TrainConfig(train_data=str(data), parallel=3)
    with pytest.raises(TrainConfigError, match="zero=7"):
        TrainConfig(train_data=str(data), parallel="zero=7")
