"""Chunked and recurrent forms of the linear-recurrence token mixers (PyTorch).

CS336 notes "注意力机制": linear attention in batch form Q(KᵀV) and recurrent form
S_t = S_{t-1} + k_t v_tᵀ, y_t = S_tᵀ q_t; Mamba-2 with a scalar decay γ_t; Gated DeltaNet
S_t = γ_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ. Two recurrences cover all three:

- ``decay_*``:  S_t = γ_t S_{t-1} + k_t v_tᵀ        (γ_t = 1: linear attention; Mamba-2/SSD)
- ``delta_*``:  S_t = γ_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ   (Gated DeltaNet)

with y_t = S_tᵀ q_t. Each has a recurrent form (one token at a time, explicit state in and out;
what decode runs) and a chunked form (chunks of C tokens: intra-chunk matmuls, then the state
passed from chunk to chunk; what training and prefill run). The delta rule's chunked form uses
the UT/WY representation: within a chunk the corrections u_t = β_t(v_t − γ-decayed S_{t−1}ᵀ k_t)
solve one unit-lower-triangular system (I + A) U = diag(β)(V − diag(Γ) K S_0), so no per-token loop.

Decays enter as log γ_t ≤ 0 (``log_decay``); within a chunk b_i = Σ_{j≤i} log γ_j and every decay
factor is exp(b_i − b_j) with j ≤ i (an exponent ≤ 0) or exp(b_i) — never 1/Γ, so nothing overflows
at any S. Internal arithmetic is fp32 (fp64 for fp64 inputs); outputs come back in q's dtype, the
state in fp32/fp64.

This is the model's own (plain PyTorch) definition of these mixers, as ``seam.reference_attention``
is for softmax attention: it lives in ``model/`` because the model may not import ``kernels/``
(pyproject's import contracts); a faster kernel would implement the same functions there.

Shapes (seed symbols): q, k (B, N, S, Hk); v (B, N, S, Hv); log_decay, beta (B, N, S);
state (B, N, Hk, Hv). Callers apply feature maps, scaling and grouping before calling.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "decay_chunked",
    "decay_recurrent",
    "delta_chunked",
    "delta_recurrent",
    "check_chunk_size",
]


def check_chunk_size(chunk_size: int) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size!r}; expected a positive int (the chunk length C)")
    return chunk_size


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check(
    q: Tensor, k: Tensor, v: Tensor, state: Tensor | None, *per_token: Tensor | None
) -> None:
    if q.dim() != 4 or q.shape != k.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"q, k must be (B, N, S, Hk) and v (B, N, S, Hv) with equal B, N, S; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    for t in per_token:
        if t is not None and t.shape != q.shape[:3]:
            raise ValueError(
                f"per-token gates must be (B, N, S) = {tuple(q.shape[:3])}, got {tuple(t.shape)}"
            )
    want = (*q.shape[:2], q.shape[3], v.shape[3])
    if state is not None and tuple(state.shape) != want:
        raise ValueError(f"state has shape {tuple(state.shape)}, expected (B, N, Hk, Hv) = {want}")


def _chunks(x: Tensor, C: int) -> Tensor:
    """(B, N, S, ...) -> (B, N, n, C, ...), zero-padding S up to n·C. Zero padding is exact here:
    a padded token has k = v = 0, β = 0 and log γ = 0, so it changes no output and no state."""
    B, N, S = x.shape[:3]
    n = -(-S // C)
    pad = n * C - S
    if pad:
        x = torch.cat([x, x.new_zeros(B, N, pad, *x.shape[3:])], dim=2)
    return x.reshape(B, N, n, C, *x.shape[3:])


def _in_chunk_decays(
    log_decay: Tensor | None, like: Tensor, C: int, strict: bool
) -> tuple[Tensor, Tensor]:
    """b (B, N, n, C) = cumulative log γ within each chunk, and the (C, C) decay matrix
    exp(b_i − b_j) on j ≤ i (j < i when ``strict``), 0 above."""
    if log_decay is None:
        b = like.new_zeros(*like.shape[:4])
    else:
        b = _chunks(log_decay.to(like.dtype), C).cumsum(-1)  # (B, N, n, C)
    keep = torch.ones(C, C, dtype=torch.bool, device=like.device).tril(-1 if strict else 0)
    diff = (b[..., :, None] - b[..., None, :]).masked_fill(
        ~keep, -torch.inf
    )  # (B, N, n, C, C), ≤ 0 where kept
    return b, diff.exp()


def decay_recurrent(
    q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor | None = None, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """S_t = γ_t S_{t−1} + k_t v_tᵀ, y_t = S_tᵀ q_t, one token at a time. -> y (B, N, S, Hv), S_final."""
    _check(q, k, v, state, log_decay)
    out_dtype, c = q.dtype, _compute_dtype(q)
    B, N, S, Hk = q.shape
    s = q.new_zeros(B, N, Hk, v.shape[-1], dtype=c) if state is None else state.to(c)
    q, k, v = q.to(c), k.to(c), v.to(c)
    ys = []
    for t in range(S):
        if log_decay is not None:
            s = log_decay[:, :, t, None, None].to(c).exp() * s
        s = s + k[:, :, t, :, None] * v[:, :, t, None, :]  # + k_t v_tᵀ
        ys.append((q[:, :, t, None, :] @ s).squeeze(2))  # q_tᵀ S_t: (B, N, Hv)
    y = torch.stack(ys, dim=2) if ys else v.new_zeros(B, N, 0, v.shape[-1])
    return y.to(out_dtype), s


def decay_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None = None,
    chunk_size: int = 64,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The same recurrence in chunks of C: y = (QKᵀ ⊙ D) V within a chunk (D_ij = exp(b_i − b_j), j ≤ i)
    plus exp(b_i) q_iᵀ S_prev from earlier chunks. -> y (B, N, S, Hv) in q's dtype, S_final."""
    C = check_chunk_size(chunk_size)
    _check(q, k, v, state, log_decay)
    out_dtype, c = q.dtype, _compute_dtype(q)
    B, N, S, Hk = q.shape
    Hv = v.shape[-1]
    qc, kc, vc = (_chunks(x.to(c), C) for x in (q, k, v))  # (B, N, n, C, H)
    b, D = _in_chunk_decays(log_decay, qc, C, strict=False)
    y = ((qc @ kc.transpose(-1, -2)) * D) @ vc  # intra-chunk: (B, N, n, C, Hv)
    last = b[..., -1:]  # (B, N, n, 1): log of the whole chunk's decay
    chunk_kv = (kc * (last - b).exp()[..., None]).transpose(
        -1, -2
    ) @ vc  # Σ_j exp(b_C − b_j) k_j v_jᵀ
    s = qc.new_zeros(B, N, Hk, Hv) if state is None else state.to(c)
    prev = []
    for i in range(qc.shape[2]):  # inter-chunk state passing
        prev.append(s)
        s = last[:, :, i, :, None].exp() * s + chunk_kv[:, :, i]
    y = y + (qc * b.exp()[..., None]) @ torch.stack(prev, dim=2)  # exp(b_i) q_iᵀ S_prev
    return y.reshape(B, N, -1, Hv)[:, :, :S].to(out_dtype), s


def delta_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Tensor | None = None,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """S_t = γ_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ, y_t = S_tᵀ q_t, one token at a time."""
    _check(q, k, v, state, beta, log_decay)
    out_dtype, c = q.dtype, _compute_dtype(q)
    B, N, S, Hk = q.shape
    s = q.new_zeros(B, N, Hk, v.shape[-1], dtype=c) if state is None else state.to(c)
    q, k, v, beta = q.to(c), k.to(c), v.to(c), beta.to(c)
    ys = []
    for t in range(S):
        if log_decay is not None:
            s = log_decay[:, :, t, None, None].to(c).exp() * s  # γ_t S_{t−1}
        kt = k[:, :, t, None, :]  # (B, N, 1, Hk)
        u = beta[:, :, t, None, None] * (
            v[:, :, t, None, :] - kt @ s
        )  # β_t (v_t − S ᵀk_t)ᵀ: (B, N, 1, Hv)
        s = s + kt.transpose(-1, -2) @ u
        ys.append((q[:, :, t, None, :] @ s).squeeze(2))
    y = torch.stack(ys, dim=2) if ys else v.new_zeros(B, N, 0, v.shape[-1])
    return y.to(out_dtype), s


def delta_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    log_decay: Tensor | None = None,
    chunk_size: int = 64,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The gated delta rule in chunks of C via the UT/WY representation.

    Per chunk (Γ_i = exp(b_i), A_ij = β_i (k_i·k_j) exp(b_i − b_j) for j < i):
      (I + A) [U | W] = diag(β) [V | diag(Γ) K]          one triangular solve for all C tokens
      u = U − W S_0                                        the chunk's corrections, (C, Hv)
      y = diag(Γ) Q S_0 + (QKᵀ ⊙ D) u,    S_C = Γ_C S_0 + (K ⊙ exp(b_C − b))ᵀ u
    """
    C = check_chunk_size(chunk_size)
    _check(q, k, v, state, beta, log_decay)
    out_dtype, c = q.dtype, _compute_dtype(q)
    B, N, S, Hk = q.shape
    Hv = v.shape[-1]
    qc, kc, vc = (_chunks(x.to(c), C) for x in (q, k, v))  # (B, N, n, C, H)
    bc = _chunks(beta.to(c), C)  # (B, N, n, C)
    b, D = _in_chunk_decays(log_decay, qc, C, strict=False)
    kk = kc @ kc.transpose(-1, -2)  # (B, N, n, C, C)
    A = bc[..., None] * kk * D.tril(-1)  # strictly lower
    eye = torch.eye(C, dtype=c, device=q.device)
    rhs = bc[..., None] * torch.cat([vc, kc * b.exp()[..., None]], dim=-1)  # diag(β)[V | diag(Γ)K]
    UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :Hv], UW[..., Hv:]  # (B, N, n, C, Hv), (B, N, n, C, Hk)
    qkD = (qc @ kc.transpose(-1, -2)) * D  # (B, N, n, C, C)
    last = b[..., -1:]
    k_to_end = kc * (last - b).exp()[..., None]  # k_j exp(b_C − b_j)
    qG = qc * b.exp()[..., None]
    s = qc.new_zeros(B, N, Hk, Hv) if state is None else state.to(c)
    ys = []
    for i in range(qc.shape[2]):
        u = U[:, :, i] - W[:, :, i] @ s  # (B, N, C, Hv)
        ys.append(qG[:, :, i] @ s + qkD[:, :, i] @ u)
        s = last[:, :, i, :, None].exp() * s + k_to_end[:, :, i].transpose(-1, -2) @ u
    y = torch.stack(ys, dim=2).reshape(B, N, -1, Hv)[:, :, :S]
    return y.to(out_dtype), s
