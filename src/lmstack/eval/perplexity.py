"""Perplexity and bits per byte of a model on a text or token file (Book of LLMs: perplexity = exp of the
mean cross-entropy; CS336 notes "基准测试": perplexity and its limits).

Strided sliding windows, as the transformers documentation ("Perplexity of fixed-length models")
describes: windows of ``max_length`` tokens start every ``stride`` tokens; each window scores only the
tokens no earlier window scored (``trg_len = end - prev_end``), so every scored token sees up to
``max_length - stride`` tokens of context. The first token of a window whose targets are the whole
window has no context and is not scored (as in that loop, where the label shift drops it), so
``stride == max_length`` gives the plain non-overlapping evaluation. The negative log-likelihoods are
summed exactly (the guide's weighting of each window's mean loss by ``num_valid - batch_size`` is one
token short for windows whose first label is masked; tests/eval/test_eval_perplexity.py).

The fast path (``window_nll``): windows of equal length run as one batch (``batch_windows`` at a
time, no padding), the unembedding and the cross-entropy run only on the scored positions (a context-only
position never forms its V logits), a chunk of positions at a time as logsumexp − target logit computed in
place on the chunk's logits (``token_nll``: no (S, V) log-softmax, no second (c, V) temporary), and the sum
stays on the device until the end (no host sync per window). The model's causal self-attention runs through
the ``onednn`` attention backend where it applies (``fast_attention``: CPU fp32, oneDNN GEMMs, block-triangular).
Constants below are measured in docs/eval.md.

Bits per byte = total negative log-likelihood / (ln 2 · bytes of the scored tokens): the byte count
does not depend on the tokenizer, so models with different vocabularies compare.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from lmstack.kernels.runtime import use_attention
from lmstack.tokenizer import is_token_file, open_tokens

CHUNK_POSITIONS = (
    128  # scored positions unembedded at once: (128, V) fp32 logits, 25 MB at V = 49152
)
BATCH_TOKENS_CPU = (
    2048  # tokens a forward on the CPU (larger batches' activations page-fault on first touch)
)
BATCH_TOKENS = 8192  # tokens a forward on other devices


@dataclass
class PerplexityResult:
    perplexity: float
    bits_per_byte: float | None  # None without a tokenizer (a token file read alone)
    nll_sum: float  # nats, over the scored tokens
    n_tokens: int  # tokens scored
    n_bytes: int | None  # bytes of the scored tokens
    n_windows: int
    max_length: int
    stride: int
    seconds: float
    tokens_per_s: float  # scored tokens per second

    def to_dict(self) -> dict:
        return asdict(self)


def windows(n: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored index within the window) of each window over ``n`` tokens (the loop of
    the transformers perplexity guide)."""
    if max_length < 2:
        raise ValueError(f"max_length={max_length} must be >= 2")
    if not (1 <= stride <= max_length):
        raise ValueError(f"stride={stride} must be in 1..max_length={max_length}")
    if n < 2:
        raise ValueError(
            f"{n} tokens: perplexity needs at least 2 (one to predict from, one to predict)"
        )
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + max_length, n)
        trg_len = end - prev_end
        out.append((begin, end, max(1, (end - begin) - trg_len)))
        prev_end = end
        if end == n:
            break
    return out


def token_bytes(tokenizer, ids) -> np.ndarray:
    """Byte length of each token id (its bytes in the byte-level vocabulary)."""
    cache: dict[int, int] = {}
    out = np.empty(len(ids), dtype=np.int64)
    for i, t in enumerate(ids):
        t = int(t)
        if t not in cache:
            cache[t] = len(tokenizer.decode_bytes([t]))
        out[i] = cache[t]
    return out


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    """Total NLL in nats over the text's bytes -> bits per byte."""
    if n_bytes <= 0:
        raise ValueError(f"n_bytes={n_bytes} must be positive")
    return nll_nats / (math.log(2) * n_bytes)


@torch.inference_mode()
def window_nll(
    model,
    tokens: torch.Tensor,
    begins: list[int],
    length: int,
    start: int,
    chunk_positions: int = CHUNK_POSITIONS,
) -> torch.Tensor:
    """Sum of −log p(tokens[b + j] | tokens[b:b + j]) over j = start .. length−1 for every window begin b
    (windows of one ``length``, scored from one ``start`` >= 1), as a float64 scalar on the model's device.

    tokens: (n,) on the device. The model sees each window without its last token; hidden states at
    positions start−1 .. length−2 predict the scored tokens."""
    idx = torch.tensor(begins, device=tokens.device)[:, None] + torch.arange(
        length, device=tokens.device
    )  # (B, S)
    x = tokens[idx]  # (B, S)
    hidden = model(x[:, :-1], return_hidden=True)[
        :, start - 1 :
    ]  # (B, S - start, D): the scored positions only
    hidden = hidden.reshape(-1, hidden.shape[-1])  # (P, D)
    target = x[:, start:].reshape(-1)  # (P,)
    total = torch.zeros((), dtype=torch.float64, device=tokens.device)
    for c0 in range(0, len(target), chunk_positions):
        total += token_nll(
            model.unembed(hidden[c0 : c0 + chunk_positions]), target[c0 : c0 + chunk_positions]
        ).sum()
    return total


def fast_attention(model):
    """Within the block, the model's softmax-attention layers run the ``onednn`` attention backend
    (``kernels.onednn_attention``: oneDNN GEMMs, block-triangular; CPU fp32 causal windows of >= ``MIN_T``
    tokens, SDPA otherwise) when they run SDPA now; restored on exit (``kernels.runtime.use_attention``). A model
    without softmax attention, or on another backend (the user's, soft-capped scores' reference), runs unchanged."""
    return use_attention(model, "onednn")


def token_nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """−log softmax(logits)[target] per row, float64: (c, V) logits, (c,) targets -> (c,). The logits are
    overwritten (they are the caller's scratch): logsumexp as torch computes it (row max m, then
    m + log Σ exp(z − m)), but in place, so no second (c, V) tensor is allocated, and m − z_target is taken in
    float64 (torch's fp32 m + log Σ rounds at the magnitude of m)."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    tl = logits.gather(-1, target[:, None])[:, 0]  # (c,) the target logits, before the overwrite
    m = logits.amax(-1, keepdim=True)  # (c, 1)
    m.masked_fill_(m.isinf(), 0.0)  # a row of ±inf: as torch.logsumexp, no inf − inf
    log_s = logits.sub_(m).exp_().sum(-1).log_()  # (c,) log Σ exp(z − m)
    return log_s.double() + (
        m[:, 0].double() - tl.double()
    )  # m − z_t exact in float64, not rounded at |m|


def perplexity(
    model,
    ids,
    max_length: int | None = None,
    stride: int | None = None,
    tokenizer=None,
    batch_windows: int | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """Perplexity of ``model`` on token ids (a list, array or memmap). ``max_length`` defaults to the
    model's context (``config.max_seq_len``), ``stride`` to ``max_length // 2``; ``batch_windows``
    (windows per forward) to as many as make ``BATCH_TOKENS_CPU`` tokens on the CPU (``BATCH_TOKENS``
    elsewhere), at most 32. The model's softmax attention runs through ``fast_attention`` meanwhile."""
    from tqdm import tqdm

    ids = np.asarray(ids, dtype=np.int64)
    V = model.config.vocab_size
    if len(ids) and (ids.min() < 0 or ids.max() >= V):
        bad = int(np.flatnonzero((ids < 0) | (ids >= V))[0])
        raise ValueError(
            f"token id {int(ids[bad])} at position {bad} is outside the model's vocabulary 0..{V - 1}"
        )
    max_length = int(max_length or model.config.max_seq_len)
    stride = int(stride or max(1, max_length // 2))
    device = next(model.parameters()).device
    if batch_windows is None:
        batch_windows = max(
            1, min(32, (BATCH_TOKENS_CPU if device.type == "cpu" else BATCH_TOKENS) // max_length)
        )
    wins = windows(len(ids), max_length, stride)
    n_tok = sum(e - b - s for b, e, s in wins)
    nbytes = token_bytes(tokenizer, ids) if tokenizer is not None else None
    n_bytes = sum(int(nbytes[b + s : e].sum()) for b, e, s in wins) if nbytes is not None else 0
    # windows with the same (length, first scored index) batch without padding: all but the first and last
    groups: dict[tuple[int, int], list[int]] = {}
    for b, e, s in wins:
        groups.setdefault((e - b, s), []).append(b)
    t0 = time.perf_counter()
    tokens = torch.as_tensor(ids, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    done = 0
    with (
        tqdm(total=n_tok, desc="perplexity", unit="tok", disable=not progress) as bar,
        fast_attention(model),
    ):
        for (length, start), begins in groups.items():
            if length <= start:  # a one-token last window (stride = max_length) scores nothing
                continue
            for g in range(0, len(begins), batch_windows):
                part = begins[g : g + batch_windows]
                total += window_nll(model, tokens, part, length, start)
                done += len(part) * (length - start)
                bar.update(len(part) * (length - start))
                if (
                    progress and device.type == "cpu"
                ):  # free there; elsewhere it would sync every batch
                    bar.set_postfix(ppl=f"{math.exp(float(total) / done):.3f}")
    nll = float(total)
    seconds = time.perf_counter() - t0
    return PerplexityResult(
        perplexity=math.exp(nll / n_tok),
        bits_per_byte=bits_per_byte(nll, n_bytes) if nbytes is not None else None,
        nll_sum=nll,
        n_tokens=n_tok,
        n_bytes=n_bytes if nbytes is not None else None,
        n_windows=len(wins),
        max_length=max_length,
        stride=stride,
        seconds=seconds,
        tokens_per_s=n_tok / max(seconds, 1e-9),
    )


def read_eval_tokens(
    path, tokenizer=None, add_bos: int | None = None, max_tokens: int | None = None
) -> np.ndarray:
    """Token ids of a token file (``lmstack tokenizer encode``: a sidecar names its dtype) or a UTF-8 text
    file encoded with ``tokenizer``; ``add_bos``: a token id to put first; ``max_tokens``: keep the first n."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such text or token file")
    if is_token_file(path, strict=True):
        ids = np.asarray(open_tokens(path), dtype=np.int64)
    else:
        if tokenizer is None:
            raise ValueError(f"{path}: a text file needs the model's tokenizer (pass --tokenizer)")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{path}: not UTF-8 text ({e}) and not a token file (no {path.name}.json sidecar)"
            ) from None
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if add_bos is not None:
        ids = np.concatenate([[add_bos], ids])
    return ids
