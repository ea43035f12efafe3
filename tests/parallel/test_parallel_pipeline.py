"""Pipeline parallelism (Book of LLMs §6.5 “pipeline parallelism and 1F1B”, CS336 notes "流水线并行"): GPipe, 1F1B and the zero-bubble
B/W split train like one process, tied embeddings included; the bubble is measured."""

import torch
from parallel_helpers import (
    assert_close_params,
    batches,
    ce,
    make_opt,
    reference,
    spawn,
    tiny_config,
)


def _pipeline(rank, world, cases):
    from lmstack.model.transformer import Transformer
    from lmstack.parallel.mesh import DeviceMesh
    from lmstack.parallel.pipeline import PipelineParallel, tied_embedding_groups

    mesh = DeviceMesh.build(pp=world)
    tied = tied_embedding_groups(mesh)
    for name, cfg, kind, m, data, wl, wp in cases:
        model = Transformer(cfg, seed=0)
        pipe = PipelineParallel(
            model, mesh.group("pp"), micro_batches=m, schedule_kind=kind, tied_group=tied
        )
        assert type(pipe.stage) is type(
            model
        )  # a stage is the model's own class holding a slice of its layers
        opt = make_opt(pipe.parameters())
        losses = []
        for x, y in data:
            losses.append(pipe.train_step(x, y, ce))
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(wl), atol=1e-5, rtol=1e-5)
        mine = {id(p) for p in pipe.stage.parameters()}
        got = {
            n.replace(".inner.", "."): p.detach()
            for n, p in model.named_parameters()
            if id(p) in mine
        }
        if pipe.tied_copy is not None:  # the last stage's copy of the tied W_e
            torch.testing.assert_close(
                pipe.tied_copy.detach(), wp["embed.weight"], atol=1e-4, rtol=1e-3
            )
        assert got
        assert_close_params(got, {n: wp[n] for n in got}, prefix=name + " ")
        bubble = pipe.measured_bubble()
        assert 0.0 <= bubble < 1.0


def _cases(kinds, L, m, ties=(False, True)):
    cases = []
    for kind in kinds:
        for tie in ties:
            cfg = tiny_config(tie_embeddings=tie, n_layers=L)
            data = batches(2, 2 * m, 8)
            wl, wp = reference(cfg, data)
            cases.append((f"{kind}-tied{tie}", cfg, kind, m, data, wl, wp))
    return cases


def test_pipeline_schedules_match_single_process():
    spawn(_pipeline, 2, _cases(("gpipe", "1f1b", "zb"), L=3, m=4))


def test_pipeline_four_stages():
    spawn(_pipeline, 4, _cases(("1f1b", "zb"), L=4, m=4, ties=(True,)))
