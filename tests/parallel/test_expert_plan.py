"""Expert parallelism through ``parallelize(model, plan)`` (CS336 notes "专家并行" + "混合并行") on gloo
ranks: (dp=1, ep=2), (dp=2, ep=2), (dp=1, ep=4), ep with ZeRO-1/2, ep×tp (tp for the attention) and tp
with replicated MoE layers each equal single-process training of the same model on the whole batch
(losses 1e-5, gathered weights 1e-4, gradient norm 1e-4); an uneven all-to-all (a rank sends no rows to
some rank, an expert gets no rows) equals the local computation, values and gradients; a sharded
checkpoint resumes bit-exactly (``torch.equal``) and its gathered ``model.safetensors`` loads into a
single-process model; the all-to-all bytes of a training step equal ``accounting.comm.moe_all_to_all_bytes``;
bad plans fail naming both values; ``torchrun -m lmstack train`` runs a plan with ep; the ``Trainer`` with
ep plans equals the single-process trainer and resumes bit-exactly; ``lmstack parallel mesh --ep``."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from parallel_helpers import (
    OPT_KW,
    assert_close_params,
    batches,
    ce,
    make_opt,
    reference,
    spawn,
    tiny_config,
)

MOE = dict(
    n_experts=4,
    n_experts_per_token=2,
    d_ff_expert=16,
    n_shared_experts=1,
    moe_first_dense=1,
    n_layers=3,
)


def _reference_norms(cfg, data):
    """Single-process: the global gradient norm before each step (AdamW as in ``reference``)."""
    from lmstack.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(cfg, seed=0)
    opt = make_opt(model.parameters())
    norms = []
    for x, y in data:
        ce(model(x), y).backward()
        norms.append(
            float(
                torch.sqrt(
                    sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None)
                )
            )
        )
        opt.step()
        opt.zero_grad()
    return norms


def _train(rank, world, cases):
    from lmstack.model.transformer import Transformer
    from lmstack.parallel.expert import ExpertParallelMoE
    from lmstack.parallel.plan import parallelize

    for name, plan, cfg, data, wl, wp, wn in cases:
        model = Transformer(cfg, seed=0)
        pm = parallelize(model, plan)
        ep = plan.get("ep", 1)
        eps = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
        assert (len(eps) == 2) == (ep > 1) and all(
            m.gate_proj.weight.shape[0] == cfg.n_experts // ep for m in eps
        )
        tp = plan.get("tp", 1)
        assert pm.mesh.dp == world // tp and pm.mesh.size("edp") == world // tp // ep
        opt = pm.build_optimizer(torch.optim.AdamW, **OPT_KW)
        losses, norms = [], []
        for x, y in data:
            losses.append(pm.forward_backward(x, y, ce))
            norms.append(float(pm.grad_norm()))
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(wl),
            atol=1e-5,
            rtol=1e-5,
            msg=lambda m: f"{name} losses: {m}",  # noqa: B023
        )
        torch.testing.assert_close(
            torch.tensor(norms),
            torch.tensor(wn),
            atol=1e-4,
            rtol=1e-4,
            msg=lambda m: f"{name} grad norms: {m}",  # noqa: B023
        )
        assert_close_params(pm.full_state_dict(), wp, prefix=name + " ")
        if ep == 1:
            continue
        # the replicas of one expert shard hold the same experts; the ep peers different ones
        w = eps[0].gate_proj.weight.detach().contiguous()
        got = [torch.empty_like(w) for _ in range(world)]
        dist.all_gather(got, w)
        for r in range(world):
            same = (r // tp) % ep == (
                rank // tp
            ) % ep  # ep coordinate = dp index mod ep, dp index = rank // tp
            assert torch.equal(got[r], w) == same, (name, r)


def _cases(world, plans):
    cfg = tiny_config(**MOE)
    data = batches(3, 8, 16, seed=5)
    wl, wp = reference(cfg, data)
    wn = _reference_norms(cfg, data)
    return [(name, plan, cfg, data, wl, wp, wn) for name, plan in plans]


@pytest.mark.slow
def test_expert_parallel_plans_on_2_ranks_equal_single_process():
    spawn(
        _train,
        2,
        _cases(
            2,
            [
                ("dp1 ep2", dict(dp=1, ep=2)),
                ("dp1 ep2 zero1", dict(dp=1, ep=2, zero=1)),
                # no ep: tp shards the attention, the MoE layers stay whole on each tp rank
                ("tp2 moe replicated", dict(tp=2)),
            ],
        ),
    )


@pytest.mark.slow
def test_expert_parallel_plans_on_4_ranks_equal_single_process():
    spawn(
        _train,
        4,
        _cases(
            4,
            [
                ("dp2 ep2", dict(dp=2, ep=2)),
                ("dp1 ep4", dict(ep=4)),
                ("dp2 ep2 zero1", dict(dp=2, ep=2, zero=1)),
                ("dp2 ep2 zero2", dict(dp=2, ep=2, zero=2)),
                ("ep2 tp2", dict(dp=1, ep=2, tp=2)),
                ("ep2 tp2 zero1", dict(ep=2, tp=2, zero=1)),
            ],
        ),
    )


def _uneven(rank, world):
    """Rank r routes its rows only to experts of ranks <= r, some experts get no rows at all: the
    all-to-all splits are uneven (zeros included) and the result equals computing locally."""
    from lmstack.parallel.expert import combine, dispatch

    E, D, T = 2 * world, 4, 5
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    ids = (
        torch.randint(0, 2 * (rank + 1), (T,), generator=g) // 2 * 2
    )  # even experts of ranks 0..r only
    recv, meta = dispatch(x, ids, E)
    if rank < world - 1:
        assert meta.send_counts[world - 1] == 0  # nothing for the last rank's experts
    assert sum(meta.send_counts) == T
    y = combine(
        recv * (meta.local_expert_ids[:, None].float() + 1), meta
    )  # expert i scales by i + 1
    torch.testing.assert_close(y, x * (ids[:, None].float() + 1))
    y.sum().backward()
    torch.testing.assert_close(x.grad, (ids[:, None].float() + 1).expand(T, D))
    counts = torch.tensor(meta.recv_counts)
    everyone = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(everyone, counts)
    assert everyone[world - 1].sum() <= T  # the last rank receives only its own rows
    assert len({tuple(c.tolist()) for c in everyone}) > 1


def test_uneven_all_to_all_split_equals_local():
    spawn(_uneven, 4)


def _resume(rank, world, tmp, plans, cfg, data, want2):
    from safetensors.torch import load_file, save_file

    from lmstack.model.transformer import Transformer
    from lmstack.parallel.checkpoint import load_sharded, save_sharded
    from lmstack.parallel.plan import parallelize

    def run(plan, steps, resume_from=None):
        model = Transformer(cfg, seed=0)
        pm = parallelize(model, plan)
        opt = pm.build_optimizer(torch.optim.AdamW, **OPT_KW)
        gen = torch.Generator().manual_seed(rank)
        start = 0
        if resume_from is not None:
            start = int(load_sharded(resume_from, pm, opt, gen)["step"])
        losses = []
        for i in range(start, steps):
            x, y = data[i]
            losses.append(pm.forward_backward(x, y, ce))
            opt.step()
            opt.zero_grad()
        return pm, opt, gen, losses

    for k, plan in enumerate(plans):
        d = Path(tmp) / f"plan{k}"
        pm, opt, gen, _ = run(plan, 2)
        full = pm.full_state_dict()

        def write_main():
            step = d / "step_00000002"  # noqa: B023
            step.mkdir(parents=True)
            save_file({n: t.contiguous() for n, t in full.items()}, str(step / "model.safetensors"))  # noqa: B023
            (step / "state.json").write_text(json.dumps({"step": 2}))
            return step

        save_sharded(d, 2, pm, opt, gen, write_main)
        for x, y in data[2:]:  # the uninterrupted run goes on
            pm.forward_backward(x, y, ce)
            opt.step()
            opt.zero_grad()
        a = pm.full_state_dict()
        pm2, _, _, _ = run(plan, len(data), resume_from=d / "step_00000002")
        b = pm2.full_state_dict()
        assert set(a) == set(b)
        for n in a:
            assert torch.equal(a[n], b[n]), (plan, n)
        shards = sorted(p.name for p in (d / "step_00000002.shards").glob("rank_*.safetensors"))
        assert len(shards) == world
        # the gathered weights load into a single-process model: equal to 2 single-process steps
        single = Transformer(cfg, seed=1)
        missing, unexpected = single.load_state_dict(
            load_file(str(d / "step_00000002" / "model.safetensors"))
        )
        assert not missing and not unexpected
        assert_close_params(
            {n: p.detach() for n, p in single.named_parameters()}, want2, prefix=f"{plan} "
        )
        dist.barrier()


@pytest.mark.slow
def test_sharded_checkpoint_resume_is_bit_exact(tmp_path):
    cfg = tiny_config(**MOE)
    data = batches(4, 8, 16, seed=7)
    _, want2 = reference(cfg, data[:2])
    spawn(_resume, 4, str(tmp_path), [dict(dp=2, ep=2), dict(dp=2, ep=2, zero=1)], cfg, data, want2)


def _bad(rank, world):
    from lmstack.model.transformer import Transformer
    from lmstack.parallel.plan import parallelize

    with pytest.raises(ValueError, match=r"n_experts=3 is not divisible by ep=2"):
        parallelize(Transformer(tiny_config(**{**MOE, "n_experts": 3}), seed=0), dict(dp=1, ep=2))
    with pytest.raises(ValueError, match=r"world size 2 != dp·ep·tp·pp·cp = 2·2·1·1·1 = 4"):
        parallelize(Transformer(tiny_config(**MOE), seed=0), dict(dp=2, ep=2))
    with pytest.raises(
        ValueError, match=r"world size 2 is not divisible by ep·tp·pp·cp = 4·1·1·1 = 4"
    ):
        parallelize(Transformer(tiny_config(**MOE), seed=0), dict(ep=4))
    with pytest.raises(ValueError, match=r"ep=2 but the model has no MoE layers"):
        parallelize(Transformer(tiny_config(), seed=0), dict(ep=2))


def _bytes(rank, world):
    """One training step of a (dp=1, ep=world) plan: the all-to-all bytes this rank sent == accounting.
    With k = E every token goes to every expert, so the split is exactly uniform ((ep-1)/ep of the rows
    leave the rank), the case ``moe_all_to_all_bytes`` describes."""
    from lmstack.accounting.comm import moe_all_to_all_bytes
    from lmstack.model.transformer import Transformer
    from lmstack.parallel import collectives as C
    from lmstack.parallel.plan import parallelize

    cfg = tiny_config(**{**MOE, "n_experts_per_token": 4})
    pm = parallelize(Transformer(cfg, seed=0), dict(ep=world))
    ((x, y),) = batches(1, 2 * world, 16, seed=1)
    with C.count_bytes() as c:
        pm.forward_backward(x, y, ce)
    T = 2 * 16  # this rank's tokens: B/world sequences of S
    assert c.sent["all_to_all"] == moe_all_to_all_bytes(cfg, T, world, "fp32")
    # by hand: 2 MoE layers · (2 forward + 2 backward all-to-alls) · T·k·D · (ep-1)/ep rows leaving · 4 bytes
    assert c.sent["all_to_all"] == 2 * 4 * T * 4 * 32 * (world - 1) // world * 4


def _bad_and_bytes(rank, world):
    _bad(rank, world)
    _bytes(rank, world)


def test_bad_ep_plans_name_both_values_and_step_all_to_all_bytes_equal_accounting():
    from lmstack.parallel.plan import ParallelPlan

    for kw, what in (
        (dict(ep=2, tp=2, sequence_parallel=True), "sequence_parallel"),
        (dict(ep=2, pp=2), "pp"),
        (dict(ep=2, zero=3), "zero=3"),
        (dict(ep=2, backend="native"), "backend='native'"),
        (dict(ep=2, cp=2), "cp"),
    ):
        with pytest.raises(ValueError, match=f"ep=2 with {what} is not supported"):
            ParallelPlan(**kw)
    with pytest.raises(ValueError, match="ep=0 must be an integer >= 1"):
        ParallelPlan(ep=0)
    spawn(_bad_and_bytes, 2)


@pytest.mark.slow
def test_torchrun_lmstack_train_with_ep_in_the_plan(tmp_path):
    """``torchrun --nproc-per-node 4 -m lmstack train --config run.toml`` with ``[parallel] dp = 2, ep = 2``:
    the run trains, every rank writes its shard, and the gathered ``model.safetensors`` holds all E experts."""
    import os
    import subprocess
    import sys

    import numpy as np
    from safetensors.torch import load_file

    rng = np.random.default_rng(0)
    ids = np.tile(np.arange(1, 33), 200)[:6000]
    ids = np.where(rng.random(ids.shape) < 0.1, rng.integers(1, 64, size=ids.shape), ids).astype(
        np.uint16
    )
    ids.tofile(tmp_path / "tokens.bin")
    (tmp_path / "tokens.bin.json").write_text(
        json.dumps({"n_tokens": len(ids), "dtype": "uint16", "vocab_size": 64})
    )
    (tmp_path / "run.toml").write_text(f'''
train_data = "{tmp_path / "tokens.bin"}"
batch_size = 2
seq_len = 16
max_steps = 3
warmup_steps = 0
eval_interval = 0
eval_batches = 1
log_interval = 1
out_dir = "{tmp_path / "run"}"
device = "cpu"
precision = "fp32"
[model]
d_model = 32
n_layers = 3
n_heads = 4
n_kv_heads = 2
d_ff = 64
vocab_size = 64
max_seq_len = 64
n_experts = 4
n_experts_per_token = 2
d_ff_expert = 16
moe_first_dense = 1
moe_aux_loss_coef = 0.01
[parallel]
dp = 2
ep = 2
''')
    torchrun = Path(sys.executable).with_name("torchrun")
    # --standalone: the rendezvous store binds port 0 itself (no port picked in advance, no race)
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node=4",
        "-m",
        "lmstack",
        "train",
        "--config",
        str(tmp_path / "run.toml"),
        "--no-progress",
    ]
    r = subprocess.run(
        cmd,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    train = [row for row in rows if row["kind"] == "train"]
    assert [row["step"] for row in train] == [1, 2, 3]
    assert all(np.isfinite(row["loss"]) and row["moe_aux_loss"] > 0 for row in train)
    assert train[0]["tokens"] == 2 * 16 * 4  # the batch is split over all dp·ep = 4 ranks
    ckpt = tmp_path / "run" / "checkpoints"
    step = sorted(p for p in ckpt.glob("step_*") if p.is_dir() and not p.name.endswith(".shards"))[
        -1
    ]
    assert len(list(Path(f"{step}.shards").glob("rank_*.safetensors"))) == 4
    plan = json.loads((Path(f"{step}.shards") / "plan.json").read_text())
    assert plan["layout"]["ep"] == 2 and plan["layout"]["dp"] == 4
    full = load_file(str(step / "model.safetensors"))
    assert full["blocks.1.ffn.gate_proj.weight"].shape == (4, 16, 32)  # all E experts, gathered


def _trainer_cfg(tmp: Path, plan, accum: int) -> dict:
    import numpy as np

    data = tmp / "tokens.bin"
    if not data.exists():
        rng = np.random.default_rng(0)
        ids = np.tile(np.arange(1, 33), 200)[:6000]
        ids = np.where(
            rng.random(ids.shape) < 0.1, rng.integers(1, 64, size=ids.shape), ids
        ).astype(np.uint16)
        ids.tofile(data)
        (tmp / "tokens.bin.json").write_text(
            json.dumps({"n_tokens": len(ids), "dtype": "uint16", "vocab_size": 64})
        )
    model = dict(d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=64, **MOE)
    return {
        "train_data": str(data),
        "batch_size": 2,
        "seq_len": 16,
        "grad_accum": accum,
        "max_steps": 3,
        "warmup_steps": 0,
        "lr": 1e-2,
        "min_lr": 1e-3,
        "eps": 1e-6,
        "weight_decay": 0.1,
        "grad_clip": 0.5,
        "eval_interval": 0,
        "eval_batches": 1,
        "log_interval": 1,
        "device": "cpu",
        "precision": "fp32",
        "parallel": plan,
        "model": model,
        "out_dir": str(tmp / ("run_" + "_".join(f"{k}{v}" for k, v in (plan or {}).items()))),
    }


def _trainer_reference(cfg: dict, n_ranks: int):
    """The single-process trainer whose micro-batch is the n ranks' micro-batches concatenated (each rank
    samples with the generator seeded by its data-parallel rank, as ``Trainer`` does)."""
    from lmstack.train.config import TrainConfig
    from lmstack.train.data import Batch, get_batch
    from lmstack.train.trainer import Trainer

    class Concat(Trainer):
        def __init__(self, c):
            super().__init__(c, progress=False)
            self.gens = [
                torch.Generator().manual_seed(c.seed * 1_000_003 + r) for r in range(n_ranks)
            ]

        def next_batch(self):
            c = self.config
            parts = [
                get_batch(self.train_tokens, c.batch_size, c.seq_len, self.device, g)
                for g in self.gens
            ]
            return Batch(torch.cat([b.x for b in parts]), torch.cat([b.y for b in parts]))

    t = Concat(TrainConfig.from_dict({**cfg, "parallel": None}))
    t.fit()
    rows = [
        json.loads(x) for x in (Path(cfg["out_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    sd = {k: v.detach().clone() for k, v in t.raw_model.state_dict().items()}
    return [x for x in rows if x["kind"] == "train"], sd


def _trainer_ep(rank, world, cfgs):
    from safetensors.torch import load_file

    from lmstack.train.config import TrainConfig
    from lmstack.train.trainer import Trainer

    for cfg, want_rows, want_sd in cfgs:
        t = Trainer(TrainConfig.from_dict(cfg), progress=False)
        assert t.dp_size == world  # every dp·ep rank samples its own rows
        t.fit()
        dist.barrier()
        if rank == 0:
            rows = [
                json.loads(x)
                for x in (Path(cfg["out_dir"]) / "metrics.jsonl").read_text().splitlines()
            ]
            rows = [x for x in rows if x["kind"] == "train"]
            assert [x["step"] for x in rows] == [x["step"] for x in want_rows]
            torch.testing.assert_close(
                torch.tensor([x["loss"] for x in rows]),
                torch.tensor([x["loss"] for x in want_rows]),
                atol=1e-5,
                rtol=1e-5,
            )
            torch.testing.assert_close(
                torch.tensor([x["grad_norm"] for x in rows]),  # clipping active (0.5)
                torch.tensor([x["grad_norm"] for x in want_rows]),
                atol=1e-5,
                rtol=1e-4,
            )
            ckpt = Path(cfg["out_dir"]) / "checkpoints"
            got = load_file(str(ckpt / (ckpt / "latest").read_text().strip() / "model.safetensors"))
            assert_close_params({k: got[k] for k in want_sd}, want_sd, prefix=f"{cfg['parallel']} ")
        dist.barrier()
    # kill-and-resume through the trainer: a run to step 4 checkpointing every 2 steps, and a second trainer
    # resumed from its step-2 checkpoint, end on the same weights (torch.equal) and log the same losses
    cfg = {**cfgs[0][0], "max_steps": 4, "ckpt_interval": 2}
    full_dir, resumed_dir = Path(cfg["out_dir"] + "_full"), Path(cfg["out_dir"] + "_resumed")
    Trainer(TrainConfig.from_dict({**cfg, "out_dir": str(full_dir)}), progress=False).fit()
    t = Trainer(TrainConfig.from_dict({**cfg, "out_dir": str(resumed_dir)}), progress=False)
    assert t.resume(full_dir / "checkpoints" / "step_00000002") == 2
    t.fit()
    dist.barrier()
    if rank == 0:

        def last(d):
            ck = d / "checkpoints"
            return load_file(str(ck / (ck / "latest").read_text().strip() / "model.safetensors"))

        a, b = last(full_dir), last(resumed_dir)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        rows = {
            d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
            for d in (full_dir, resumed_dir)
        }
        la = [x["loss"] for x in rows[full_dir] if x["kind"] == "train" and x["step"] > 2]
        lb = [x["loss"] for x in rows[resumed_dir] if x["kind"] == "train" and x["step"] > 2]
        assert la == lb and len(la) == 2
    dist.barrier()


@pytest.mark.slow
def test_trainer_with_ep_plans_equals_single_process_trainer(tmp_path):
    """``Trainer`` (what ``torchrun -m lmstack train`` runs) with {dp=2, ep=2} (grad_accum 2: no_sync) and
    {ep=2, dp=2, zero=1} on 4 ranks == one process on the 4 ranks' batches: losses, clipped grad norms, weights;
    a {dp=2, ep=2} run resumed from its step-2 checkpoint ends bit-exactly on the uninterrupted run's weights."""
    cases = []
    for plan, accum in (({"dp": 2, "ep": 2}, 2), ({"dp": 2, "ep": 2, "zero": 1}, 1)):
        cfg = _trainer_cfg(tmp_path, plan, accum)
        rows, sd = _trainer_reference({**cfg, "out_dir": cfg["out_dir"] + "_ref"}, 4)
        cases.append((cfg, rows, sd))
    spawn(_trainer_ep, 4, cases)


def test_parallel_mesh_cli_prints_the_ep_coordinate(capsys):
    """``lmstack parallel mesh --world 8 --tp 2 --ep 2``: ranks (0,1), (4,5) hold expert shard 0 and (2,3), (6,7)
    shard 1 (by hand: dp index = rank // tp, ep coordinate = dp mod ep); world not divisible by tp·ep fails."""
    from lmstack.cli import main

    assert main(["parallel", "mesh", "--world", "8", "--tp", "2", "--ep", "2"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("rank")]
    assert [int(x.split("ep=")[1]) for x in lines] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert main(["parallel", "mesh", "--world", "6", "--tp", "2", "--ep", "2"]) != 0
    out = capsys.readouterr()
    assert "world=6 is not divisible by tp·pp·cp·ep = 4" in out.out + out.err
