"""GRPO / expert iteration with rollouts on lmstack's engine, on a tiny model: the reward rises, runs are
reproducible, a killed run resumes to the same weights, the engine serves the updated weights (greedy output =
a fresh engine's) and never stale prefix-cache K/V, bad input is refused with the reason."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from lmstack.align.grpo import GRPOConfig, GRPOTrainer
from lmstack.inference import LLM
from lmstack.inference.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from align_helpers import byte_chat_tokenizer, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
V = 259  # the byte tokenizer's size: every sampled id decodes


def a_rate(problem, completion):
    """A reward a random tiny model can climb: the fraction of 'a' characters in the completion."""
    return completion.count("a") / max(len(completion), 1)


def _config(tmp_path, **kw):
    base = dict(
        steps=2,
        prompts_per_step=4,
        num_generations=8,
        max_new_tokens=8,
        lr=1e-2,
        chat=False,
        stop=(),
        eval_problems=4,
        train_problems=64,
        out_dir=str(tmp_path / "run"),
        epochs=2,
        micro_batch=16,
        seed=0,
    )
    return GRPOConfig(**(base | kw))


def _trainer(tmp_path, seed=0, **kw):
    return GRPOTrainer(
        _config(tmp_path, **kw),
        tiny_model(seed=seed, vocab_size=V, max_seq_len=128),
        byte_chat_tokenizer(),
        progress=False,
        reward_fns={"a": a_rate},
    )


@pytest.mark.slow
def test_grpo_reward_rises_on_a_task_a_tiny_model_can_learn(tmp_path):
    trainer = _trainer(tmp_path, steps=10)
    trainer.fit()
    rewards = [r["reward"] for r in trainer.history if "reward" in r]
    assert sum(rewards[-3:]) / 3 > 3 * sum(rewards[:3]) / 3, rewards
    row = trainer.history[-1]
    for key in (
        "clip_ratio/low",
        "clip_ratio/high",
        "entropy",
        "frac_reward_zero_std",
        "completion_length",
        "truncated",
        "gen_s",
        "logprob_s",
        "train_s",
        "gen_tokens_per_s",
        "rewards/a",
        "eval_accuracy",
    ):
        assert key in row, key
    assert (tmp_path / "run" / "grpo.png").stat().st_size > 0
    assert row["clip_ratio/region"] > 0  # μ = 2 epochs: the second sees ρ ≠ 1


@pytest.mark.slow
def test_same_seed_same_rollouts_losses_and_weights(tmp_path):
    runs = []
    for k in range(2):
        t = _trainer(tmp_path / str(k))
        rows = [t.train_step() for _ in range(2)]
        runs.append((rows, [p.detach().clone() for p in t.model.parameters()]))
    (rows_a, w_a), (rows_b, w_b) = runs
    for ra, rb in zip(rows_a, rows_b):
        assert (ra["reward"], ra["loss"], ra["completion_length"]) == (
            rb["reward"],
            rb["loss"],
            rb["completion_length"],
        )
    for a, b in zip(w_a, w_b):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_micro_batches_add_up_to_the_whole_rollout_batch(tmp_path, loss_type):
    """The loss of a rollout batch does not depend on how it is cut into micro-batches: 32 rows as one
    micro-batch (the reference) or as four of 8 give the same logged loss and gradient norm."""
    rows = []
    for mb in (32, 8):
        t = _trainer(tmp_path / str(mb), loss_type=loss_type, micro_batch=mb, epochs=1)
        rows.append(t.train_step())
    one, four = rows
    assert four["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert four["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights(tmp_path):
    small = dict(steps=3, eval_problems=1, prompts_per_step=2, num_generations=4)
    straight = _trainer(tmp_path / "a", **small)
    straight.fit()
    killed = _trainer(tmp_path / "b", **small)
    killed.train_step(), killed.train_step()
    killed.save_checkpoint()  # what ckpt_interval=2 writes; the process then dies
    resumed = _trainer(tmp_path / "b", seed=7, **small)  # other initial weights: all from the file
    assert resumed.resume() == 2
    resumed.fit()
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_engine_serves_the_updated_weights_and_no_stale_prefix(tmp_path):
    trainer = _trainer(tmp_path)
    prompt = trainer.train_prompts[0]  # 60-odd tokens: several full prefix-cache blocks of 16
    greedy = SamplingParams(temperature=0, max_tokens=12)
    trainer.llm.generate([prompt], greedy)  # caches the prompt's blocks under the old weights
    trainer.train_step()  # updates the shared weights in place, then resets the prefix cache
    ours = trainer.llm.generate([prompt], greedy)[0]
    fresh = (
        LLM(copy.deepcopy(trainer.model), trainer.tokenizer).generate([prompt], greedy)[0].token_ids
    )
    assert ours.token_ids == fresh
    assert ours.num_cached_tokens == 0  # nothing was served from K/V computed before the update

    # the negative control: change the weights without the reset and the stale cached K/V are served
    llm = trainer.llm
    llm.generate([prompt], greedy)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stale = llm.generate([prompt], greedy)[0]
    assert stale.num_cached_tokens > 0
    llm.engine.reset_prefix_cache()
    fresh = (
        LLM(copy.deepcopy(trainer.model), trainer.tokenizer).generate([prompt], greedy)[0].token_ids
    )
    assert llm.generate([prompt], greedy)[0].token_ids == fresh


def test_expert_iteration_trains_on_verified_samples(tmp_path):
    t = GRPOTrainer(
        _config(tmp_path, algorithm="expert_iteration"),
        tiny_model(vocab_size=V, max_seq_len=128),
        byte_chat_tokenizer(),
        progress=False,
        reward_fns={"correct": lambda p, c: float(c.count("a") > 0)},
    )
    before = [p.detach().clone() for p in t.model.parameters()]
    m = t.train_step()
    assert m["kept"] == round(m["rewards/correct"] * 32)
    assert m["kept"] == 0 or any(
        not torch.equal(a, b) for a, b in zip(before, t.model.parameters())
    )


def test_a_failing_reward_scores_zero_and_the_run_goes_on(tmp_path):
    def flaky(problem, completion):
        if "a" in completion:
            raise RuntimeError("verifier crashed")
        return float("nan") if "b" in completion else 1.0

    t = GRPOTrainer(
        _config(tmp_path),
        tiny_model(vocab_size=V, max_seq_len=128),
        byte_chat_tokenizer(),
        progress=False,
        reward_fns={"flaky": flaky},
    )
    m = t.train_step()
    assert m["reward_failures/flaky"] > 0 and m["reward"] == pytest.approx(
        1 - m["reward_failures/flaky"] / 32
    )


def test_bad_input_is_refused_with_the_reason(tmp_path):
    with pytest.raises(
        ValueError, match="num_generations=1 with advantage='group': a group of one sample"
    ):
        _config(tmp_path, num_generations=1)
    _config(tmp_path, num_generations=1, advantage="batch")  # a batch baseline needs no group
    with pytest.raises(
        ValueError,
        match=r"train prompt \d+ has \d+ tokens: with max_new_tokens=100 it exceeds the "
        "model's context of 128 tokens",
    ):
        _trainer(tmp_path, max_new_tokens=100)
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        _config(tmp_path, loss_type="ppo")


def test_paired_accuracy_at_hand_worked_numbers():
    """2/10 → 6/10 with 5 problems fixed and 1 broken: Wilson 95% intervals from the closed form
    (k + z²/2)/(n + z²) ± z/(n + z²)·√(k(n−k)/n + z²/4), and McNemar's exact p = 2·P(X ≤ 1), X ~ Bin(6, ½)
    = 2·7/64."""
    from lmstack.align.grpo import paired_accuracy

    before = [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    after = [1, 0, 1, 1, 1, 1, 1, 0, 0, 0]
    r = paired_accuracy(before, after)
    z, n = 1.959963984540054, 10

    def wilson(k):
        c, h = (k + z * z / 2) / (n + z * z), z / (n + z * z) * (k * (n - k) / n + z * z / 4) ** 0.5
        return [c - h, c + h]

    assert (r["fixed"], r["broken"], r["problems"]) == (5, 1, 10)
    assert r["before"]["accuracy"] == 0.2 and r["after"]["accuracy"] == 0.6
    assert r["before"]["ci"] == pytest.approx(wilson(2), abs=1e-9)
    assert r["after"]["ci"] == pytest.approx(wilson(6), abs=1e-9)
    assert r["mcnemar_p"] == pytest.approx(14 / 64)
    with pytest.raises(ValueError, match="two equal non-empty lists; got 10 and 3"):
        paired_accuracy(before, after[:3])


def test_bf16_autocast_learner(tmp_path):
    """precision="bf16": the learner's log-probs are torch's bf16 autocast forward (differ from fp32), a step
    trains, the config records it; an unknown precision is refused with the choices."""
    from lmstack.align.data import Example, collate
    from lmstack.align.logprobs import batch_logprobs

    t = _trainer(tmp_path, precision="bf16")
    assert t.config.precision == "bf16"
    b = collate([Example([1, 2, 3, 4], [5, 6, 7])], 0)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = batch_logprobs(t.model, b)[0]
        fp32 = batch_logprobs(t.model, b)[0]
        got = t.logprobs(t.model, b)[0]
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert not torch.equal(got, fp32)
    before = [p.detach().clone() for p in t.model.parameters()]
    t.train_step()
    assert any(not torch.equal(a, p) for a, p in zip(before, t.model.parameters()))
    with pytest.raises(ValueError, match="precision='int8'; expected one of"):
        _config(tmp_path, precision="int8")
