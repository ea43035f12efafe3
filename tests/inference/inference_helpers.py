"""Helpers for the inference tests: small random lmstack models in float64 (so that no argmax
near-tie can flip between two summation orders) and the full-recompute greedy reference."""

import torch

from lmstack.inference import DraftModel, PromptLookup, SamplingParams, generate
from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer


def greedy(n, **kw) -> SamplingParams:
    """Greedy sampling of ``n`` new tokens (``SamplingParams`` defaults to temperature 1)."""
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def speculate(target, prompt, n, params=None, draft=None, k=4, stop_ids=(), seed=0):
    """``generate`` with draft-model (``draft``) or prompt-lookup speculation -> (tokens, stats)."""
    params = params or SamplingParams(temperature=0.0)
    params = SamplingParams(
        **{
            **vars(params),
            "max_tokens": n,
            "stop_token_ids": tuple(stop_ids),
            "seed": params.seed if params.seed is not None else seed,
        }
    )
    spec = DraftModel(draft, k) if draft is not None else PromptLookup(k)
    return list(generate(target, prompt, params, speculation=spec)), spec.stats


def make_model(vocab_size=97, n_layers=2, seed=1, init_std=0.02, dtype=torch.float64, **kw):
    cfg = ModelConfig(
        vocab_size=vocab_size,
        d_model=64,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        d_ff=128,
        max_seq_len=256,
        init_std=init_std,
        **kw,
    )
    return Transformer(cfg, dtype=dtype, seed=seed).eval()


@torch.no_grad()
def full_recompute_greedy(model, prompt, n, stop_ids=()):
    """Reference: no cache at all; the whole sequence is run again for every new token."""
    ids, out = list(prompt), []
    for _ in range(n):
        t = int(model(torch.tensor([ids]))[0, -1].argmax())
        out.append(t)
        ids.append(t)
        if t in stop_ids:
            break
    return out


@torch.no_grad()
def full_recompute_greedy_penalized(model, prompt, n, penalty, stop_ids=()):
    """Reference for greedy decoding under a repetition penalty (CTRL, Keskar et al. 2019), written
    plainly: every token id seen so far (prompt and output, each once) has a positive logit
    divided by the penalty and a negative one multiplied by it; then the argmax. No cache."""
    ids, out = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1].tolist()
        for t in set(ids):
            logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
        t = max(range(len(logits)), key=logits.__getitem__)
        out.append(t)
        ids.append(t)
        if t in stop_ids:
            break
    return out


def hf_render_chat(template, messages, add_generation_prompt, bos_token=None, eos_token=None):
    """transformers' own chat rendering through its public API: a ``PreTrainedTokenizerFast``
    (over an empty word-level vocabulary: rendering text needs no vocabulary) carrying the
    template and the special tokens, ``apply_chat_template(..., tokenize=False)``."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        bos_token=bos_token,
        eos_token=eos_token,
        chat_template=template,
    )
    return tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
