"""GRPO's ``rollout_dtype="bf16"``: the engine's rollouts compute their linear products (and the tied unembedding)
as bf16 GEMMs with fp32 outputs, equal to a torch reference with every product ``F.linear`` on bf16 casts; the
packed bf16 copies follow the optimizer's in-place updates; the learner's log-probs never change with it; bad
values are refused and "auto" follows the CPU's native bf16."""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lmstack.model.layers as layers
import lmstack.model.transformer as transformer
from lmstack.align.data import Example
from lmstack.align.grpo import GRPOConfig, GRPOTrainer, choose_rollout_dtype
from lmstack.cpu import FAKE_CPUS
from lmstack.inference import LLM
from lmstack.inference.sampling import SamplingParams
from lmstack.ops import gemm

sys.path.insert(0, str(Path(__file__).parent))
from align_helpers import byte_chat_tokenizer, tiny_model  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        not torch.cpu._is_amx_tile_supported(),
        reason="the CPU lacks AMX: bf16 rollouts are packed for an AMX CPU",
    ),
]
V = 259


def _bf16_linear(x, w, b=None, views=()):
    """The reference product: torch's F.linear on bf16 casts, the result in fp32."""
    y = F.linear(x.bfloat16(), w.bfloat16()).float()
    return y if b is None else y + b


def _reference(model, prompt, n, monkeypatch):
    """Greedy tokens and their log-probs from the model's full-sequence forward (no KV cache) with every
    linear product replaced by ``_bf16_linear``."""
    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(layers, "linear", _bf16_linear)
        m.setattr(transformer, "linear", _bf16_linear)
        ids, toks, lps = list(prompt), [], []
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([ids]))[0, -1].float(), -1)
            t = int(logp.argmax())
            toks.append(t), lps.append(float(logp[t])), ids.append(t)
    return toks, lps


def _trainer(tmp_path, rollout_dtype, seed=0):
    cfg = GRPOConfig(
        steps=1,
        prompts_per_step=2,
        num_generations=4,
        max_new_tokens=8,
        lr=1e-2,
        chat=False,
        stop=(),
        eval_problems=2,
        train_problems=16,
        out_dir=str(tmp_path / rollout_dtype),
        micro_batch=8,
        rollout_dtype=rollout_dtype,
    )
    return GRPOTrainer(
        cfg,
        tiny_model(seed=seed, vocab_size=V, max_seq_len=128),
        byte_chat_tokenizer(),
        progress=False,
        reward_fns={"a": lambda p, c: c.count("a") / max(len(c), 1)},
    )


def test_bf16_rollout_equals_f_linear_in_bf16(monkeypatch):
    """Greedy tokens equal, log-probs within 1e-5 of the bf16 reference (measured: equal; attention's
    summation order may differ, paged decode vs full recompute), while the fp32 engine's are ~8e-4 away (the
    check tells the two precisions apart)."""
    model = tiny_model(seed=1, vocab_size=V, max_seq_len=128)
    prompt = list(b"what is 12 + 30? answer: ")
    llm = LLM(model, byte_chat_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0)
    with gemm.inference_dtype(torch.bfloat16):
        out = llm.generate([prompt], params)[0]
    want, want_lp = _reference(model, prompt, 10, monkeypatch)
    assert out.token_ids == want
    got_lp = [lp for lp, _ in out.logprobs]
    assert got_lp == pytest.approx(want_lp, abs=1e-5)
    fp32 = llm.generate([prompt], params)[
        0
    ]  # outside the block: fp32 again, measurably another precision
    assert max(abs(lp - w) for (lp, _), w in zip(fp32.logprobs, want_lp)) > 1e-4


def test_the_bf16_copy_follows_the_optimizer_step(tmp_path):
    """After an optimizer step (in place on the weights the engine shares) the engine's bf16 greedy output and
    log-probs equal a fresh engine's on a copy of the new weights; the packed copies are bf16."""
    trainer = _trainer(tmp_path, "bf16")
    assert trainer.config.rollout_dtype == "bf16"
    prompt = trainer.train_prompts[0]
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=0)

    def run(llm):
        out = llm.generate([prompt], greedy)[0]
        return out.token_ids, [lp for lp, _ in out.logprobs]

    with gemm.inference_dtype(torch.bfloat16):
        trainer.train_step()  # a bf16 rollout (packs the bf16 copies) and the learner's step
        before = run(trainer.llm)
        g = torch.Generator().manual_seed(0)
        for p in trainer.model.parameters():  # one more optimizer step, surely non-zero
            p.grad = torch.randn(p.shape, generator=g)
        trainer.optimizer.step()
        trainer.llm.engine.reset_prefix_cache()  # as train_step does after its step
        ours = run(trainer.llm)
        fresh = run(LLM(copy.deepcopy(trainer.model), trainer.tokenizer))
    assert ours[0] == fresh[0] and ours[1] == pytest.approx(fresh[1], abs=1e-6)
    # the step moved the log-probs far more than that: a stale copy would have been caught
    assert max(abs(a - b) for a, b in zip(ours[1], before[1])) > 1e-3
    mine = {id(p) for p in trainer.model.parameters()} | {
        id(m.weight) for m in trainer.model.modules() if hasattr(m, "weight")
    }
    packed = [v[2] for k, v in gemm._PACKED.items() if k in mine]
    assert packed and all(p.dtype == torch.bfloat16 for p in packed)


def test_learner_logprobs_do_not_depend_on_rollout_dtype(tmp_path):
    """The same samples scored by the learner of an fp32-rollout and a bf16-rollout trainer (both after a
    rollout, so the bf16 one holds packed bf16 copies): bit-equal log-probs, and equal to the plain model's."""
    a, b = _trainer(tmp_path, "fp32"), _trainer(tmp_path, "bf16")
    for t in (a, b):
        with gemm.inference_dtype(torch.bfloat16 if t.config.rollout_dtype == "bf16" else None):
            t.rollout([t.train_prompts[0]], step=0)
    g = torch.Generator().manual_seed(0)
    examples = [
        Example(list(a.train_prompts[k]), torch.randint(0, 256, (6,), generator=g).tolist())
        for k in range(4)
    ]
    batches = a._batches(examples)
    la, lb = a._logps(a.model, batches), b._logps(b.model, batches)
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    with (
        torch.no_grad()
    ):  # independent: log_softmax of the plain model's fp32 logits at the targets
        for bt, lp in zip(batches, la):
            logits = a.model(bt.x).float()  # (B, S, V)
            ref = torch.log_softmax(logits, -1).gather(-1, bt.y.clamp(min=0)[..., None])[..., 0]
            m = bt.y != -100
            torch.testing.assert_close(lp[m], ref[m], atol=1e-5, rtol=1e-5)


def test_rollout_dtype_is_checked_and_auto_follows_the_cpu():
    with pytest.raises(ValueError, match="rollout_dtype='fp16'"):
        GRPOConfig(rollout_dtype="fp16")
    faster = lambda n: {"bf16": 2.0, "fp32": 1.0}  # noqa: E731
    slower = lambda n: {"bf16": 0.5, "fp32": 1.0}  # noqa: E731
    assert choose_rollout_dtype("auto", "cpu", FAKE_CPUS["amx"], faster)[0] == "bf16"
    assert choose_rollout_dtype("auto", "cpu", FAKE_CPUS["amx"], slower)[0] == "fp32"
    assert choose_rollout_dtype("auto", "cpu", FAKE_CPUS["avx2"], faster)[0] == "fp32"  # emulated
    assert choose_rollout_dtype("bf16", "cpu", FAKE_CPUS["avx2"])[0] == "bf16"  # as configured
    assert choose_rollout_dtype("auto", "cuda")[0] == "fp32"
    with pytest.raises(ValueError, match="CPU rollouts"):
        choose_rollout_dtype("bf16", "cuda")
