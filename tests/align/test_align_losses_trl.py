"""lmstack.align.losses against TRL, the library people train with.

- DPO: TRL's ``DPOTrainer`` built on a tiny random HF ``LlamaForCausalLM`` (from a config, no hub) computes
  its loss on a chosen/rejected batch; lmstack computes the same loss from lmstack's own forward of the same
  weights (``hf_llama_pair``) through ``token_logprobs`` + ``dpo_loss``. Loss values and the gradients of the
  embedding and unembedding must agree, for each loss type.
- GRPO: TRL's ``GRPOTrainer._compute_loss`` with its log-prob computation replaced by a given tensor (the
  "same log-probs"), for each loss_type; loss, gradient w.r.t. the log-probs, KL and clip fractions.
- SFT: TRL's ``SFTTrainer.compute_loss`` with completion-only labels vs ``sft_loss(normalize="token")``.
"""

import pytest
import torch

from lmstack.align.losses import (
    dpo_loss,
    dpo_rewards,
    grpo_loss,
    sft_loss,
    token_logprobs,
)

trl = pytest.importorskip("trl", reason="TRL is the reference for the alignment losses")
pytestmark = pytest.mark.filterwarnings("ignore")

V = 64


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(V - 4)} | {"<unk>": V - 4, "<pad>": V - 3, "<eos>": V - 2}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def _batch():
    """Two preference pairs, right-padded, rows [chosen_0, chosen_1, rejected_0, rejected_1] as TRL orders them."""
    ids = torch.tensor(
        [
            [5, 9, 3, 11, 12, 0, 0],
            [7, 8, 2, 1, 20, 30, 0],
            [5, 9, 3, 40, 41, 42, 43],
            [7, 8, 2, 1, 50, 0, 0],
        ]
    )
    attn = (torch.arange(7) < torch.tensor([5, 6, 7, 5])[:, None]).long()
    completion = attn.clone()
    completion[:, :3] = 0  # prompts: the first 3 tokens (the second pair's prompt has 4)
    completion[[1, 3], 3] = 0
    return ids, attn, completion


def _lmstack_seq_logps(model, ids, completion):
    """Σ over the response of log π(token) from lmstack's forward: labels = next token where it is response."""
    logits = model(ids)[:, :-1]  # (B, S-1, V)
    targets = ids[:, 1:].masked_fill(completion[:, 1:] == 0, -100)
    return token_logprobs(logits, targets).sum(-1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss_type,label_smoothing", [("sigmoid", 0.0), ("ipo", 0.0), ("robust", 0.2), ("hinge", 0.0)]
)
def test_dpo_loss_and_gradients_equal_trl(
    hf_llama_pair, hf_tokenizer, tmp_path, loss_type, label_smoothing
):
    from datasets import Dataset

    hf_policy, ours = hf_llama_pair(vocab_size=V, seed=0)
    hf_ref, ours_ref = hf_llama_pair(vocab_size=V, seed=1)
    beta = 0.5
    args = trl.DPOConfig(
        output_dir=str(tmp_path),
        loss_type=[loss_type],
        beta=beta,
        label_smoothing=label_smoothing,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    ds = Dataset.from_dict({"prompt": ["w1"], "chosen": ["w2"], "rejected": ["w3"]})
    trainer = trl.DPOTrainer(
        model=hf_policy,
        ref_model=hf_ref,
        args=args,
        train_dataset=ds,
        processing_class=hf_tokenizer,
    )
    ids, attn, completion = _batch()
    trainer.model.train()
    theirs = trainer._compute_loss(
        trainer.model,
        {"input_ids": ids, "attention_mask": attn, "completion_mask": completion},
        False,
    )
    theirs.backward()

    ours.train()
    logps = _lmstack_seq_logps(ours, ids, completion)
    with torch.no_grad():
        ref_logps = _lmstack_seq_logps(ours_ref, ids, completion)
    lengths = completion.sum(-1).float()
    loss = dpo_loss(
        logps[:2],
        logps[2:],
        ref_logps[:2],
        ref_logps[2:],
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        chosen_lengths=lengths[:2],
        rejected_lengths=lengths[2:],
    ).mean()
    loss.backward()
    torch.testing.assert_close(loss.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        ours.embed.weight.grad, hf_policy.model.embed_tokens.weight.grad, rtol=1e-4, atol=1e-7
    )
    torch.testing.assert_close(
        ours.lm_head.weight.grad, hf_policy.lm_head.weight.grad, rtol=1e-4, atol=1e-7
    )
    assert (
        float(hf_policy.lm_head.weight.grad.abs().max()) > 1e-4
    )  # the gradient compared is not ~0

    if (
        loss_type == "sigmoid"
    ):  # TRL's logged metrics: rewards/chosen, rejected, margins, accuracies
        m = dpo_rewards(logps[:2], logps[2:], ref_logps[:2], ref_logps[2:], beta=beta)
        logged = trainer._metrics["train"]
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
            assert float(m[key]) == pytest.approx(logged[key][-1], rel=1e-5, abs=1e-6), key


def _grpo_trainer(make_hf_llama, hf_tokenizer, tmp_path, loss_type, eps_low, eps_high, max_len, G):
    from datasets import Dataset

    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        loss_type=loss_type,
        beta=0.0,
        epsilon=eps_low,
        epsilon_high=eps_high,
        num_generations=G,
        per_device_train_batch_size=4,
        max_completion_length=max_len,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    return trl.GRPOTrainer(
        model=make_hf_llama(vocab_size=V),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["w1 w2"] * 4}),
        processing_class=hf_tokenizer,
    )


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta,kl_correction", [(0.0, False), (0.04, False), (0.04, True)])
def test_grpo_loss_equals_trl(
    make_hf_llama, hf_tokenizer, tmp_path, loss_type, beta, kl_correction
):
    B, T, max_len, eps_low, eps_high = 4, 6, 8, 0.2, 0.28
    trainer = _grpo_trainer(
        make_hf_llama, hf_tokenizer, tmp_path, loss_type, eps_low, eps_high, max_len, G=2
    )
    trainer.beta = (
        beta  # set after construction: a beta > 0 config would load a reference model from the hub
    )
    trainer.args.use_bias_correction_kl = kl_correction
    g = torch.Generator().manual_seed(0)
    base = -torch.rand(B, T, generator=g) * 2
    old = base + 0.3 * torch.randn(B, T, generator=g)  # ratios spread across both clip edges
    ref = base + 0.3 * torch.randn(B, T, generator=g)
    mask = torch.tensor(
        [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    )
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])

    theirs_logp = base.clone().requires_grad_()
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (
        theirs_logp,
        torch.ones(B, T),
        None,
    )
    trainer.model.eval()  # eval mode: no gradient-accumulation normaliser in TRL's loss
    inputs = dict(
        prompt_ids=torch.ones(B, 2, dtype=torch.long),
        prompt_mask=torch.ones(B, 2, dtype=torch.long),
        completion_ids=torch.ones(B, T, dtype=torch.long),
        completion_mask=mask,
        advantages=adv,
        old_per_token_logps=old,
        ref_per_token_logps=ref,
        num_items_in_batch=mask.sum(),
    )
    theirs = trainer._compute_loss(trainer.model, inputs)
    theirs.backward()

    ours_logp = base.clone().requires_grad_()
    loss, metrics = grpo_loss(
        ours_logp,
        old,
        adv,
        mask,
        loss_type=loss_type,
        eps_low=eps_low,
        eps_high=eps_high,
        beta=beta,
        ref_logp=ref,
        max_len=max_len,
        num_tokens=mask.sum(),
        kl_ratio_correction=kl_correction,
    )
    loss.backward()
    torch.testing.assert_close(loss.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, rtol=1e-6, atol=1e-7)
    logged = trainer._metrics["eval"]
    assert metrics["clip_ratio/low"] == pytest.approx(logged["clip_ratio/low_mean"][-1], abs=1e-7)
    assert metrics["clip_ratio/high"] == pytest.approx(logged["clip_ratio/high_mean"][-1], abs=1e-7)
    assert metrics["clip_ratio/region"] == pytest.approx(
        logged["clip_ratio/region_mean"][-1], abs=1e-7
    )
    assert (
        metrics["clip_ratio/low"] + metrics["clip_ratio/high"] > 0
    )  # the batch does exercise the clip
    if (
        beta and not kl_correction
    ):  # TRL logs the ρ-weighted term; lmstack logs the k3 estimate itself
        assert metrics["kl"] == pytest.approx(logged["kl"][-1], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("normalize", ["token"])
def test_sft_completion_only_loss_equals_trl(hf_llama_pair, hf_tokenizer, tmp_path, normalize):
    from datasets import Dataset

    hf, ours = hf_llama_pair(vocab_size=V, seed=2)
    ids, attn, completion = _batch()
    rows = [(r[a.bool()].tolist(), c[a.bool()].tolist()) for r, a, c in zip(ids, attn, completion)]
    ds = Dataset.from_dict(
        {"input_ids": [r for r, _ in rows], "completion_mask": [c for _, c in rows]}
    )
    args = trl.SFTConfig(
        output_dir=str(tmp_path), completion_only_loss=True, report_to=[], use_cpu=True, bf16=False
    )
    trainer = trl.SFTTrainer(model=hf, args=args, train_dataset=ds, processing_class=hf_tokenizer)
    batch = trainer.data_collator(
        [trainer.train_dataset[i] for i in range(len(rows))]
    )  # TRL's labels
    labels = ids.masked_fill(completion == 0, -100)
    trainer.model.train()
    theirs = trainer.compute_loss(trainer.model, batch)
    theirs.backward()

    ours.train()
    logits = ours(ids)[:, :-1]
    logp = token_logprobs(logits, labels[:, 1:])
    loss = sft_loss(logp, completion[:, 1:], normalize=normalize)
    loss.backward()
    torch.testing.assert_close(loss.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        ours.lm_head.weight.grad, hf.lm_head.weight.grad, rtol=1e-4, atol=1e-7
    )
