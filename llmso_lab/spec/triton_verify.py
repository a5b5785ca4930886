"""Speculative-decoding verification as one Triton kernel: the GPU twin of verify.verify_batch_reference.

One program per batch row. It walks the row's drafts in order (accept d_i iff u_i * q_i(d_i) < p_i(d_i)) and
remembers where the leading run of acceptances stops, then makes one pass over the vocabulary in tiles of BLOCK_V,
keeping a running max / argmax of the exponential-race scores (see verify.race_scores) for two candidates at once:
the residual max(0, p - q) and p itself (the fallback when the residual is all zeros). Only elementwise ops,
comparisons and argmaxes with ties to the lowest index, so the result equals the torch reference bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmso_lab.attention.backend import check_kernel_inputs
from llmso_lab.spec.verify import _prepare_batch

__all__ = ["verify_batch_triton"]


@triton.jit
def _verify_kernel(
    P, Q, D, N, U, INV_NOISE, OUT, NUM_EMITTED,
    k, V, stride_pb, stride_pk, stride_qb, stride_qk,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(N + b)                       # this row's number of real drafts
    p_row = P + b * stride_pb
    q_row = Q + b * stride_qb

    # 1. Acceptance: the leading run of accepted drafts. Triton has no `break`: `still` turns 0 at the first rejection.
    n_acc = n * 0
    still = n * 0 + 1
    for i in range(0, n):
        d = tl.load(D + b * k + i)
        p_d = tl.load(p_row + i * stride_pk + d)
        q_d = tl.load(q_row + i * stride_qk + d)
        u = tl.load(U + b * k + i)
        still = still * (u * q_d < p_d).to(still.dtype)
        n_acc += still

    # 2. The one non-draft token: exponential race over the vocabulary, in tiles, with a running max / argmax.
    p_stop = p_row + n_acc * stride_pk        # p_i at the stop position (p_{num_draft} when all were accepted)
    q_stop = q_row + n_acc * stride_qk        # q_i, read only when a draft was rejected (then n_acc < n <= k)
    best_r = tl.full([], float("-inf"), tl.float32)
    best_p = tl.full([], float("-inf"), tl.float32)
    idx_r = tl.full([], 0, tl.int64)
    idx_p = tl.full([], 0, tl.int64)
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        in_vocab = cols < V
        p = tl.load(p_stop + cols, mask=in_vocab, other=0.0)
        rejected = cols * 0 + n_acc < n   # "a draft was rejected", one copy per lane (the interpreter wants a vector)
        q = tl.load(q_stop + cols, mask=in_vocab & rejected, other=0.0)
        inv = tl.load(INV_NOISE + b * V + cols, mask=in_vocab, other=1.0)
        residual = tl.maximum(p - q, 0.0)
        score_r = tl.where(in_vocab, tl.where(residual > 0, residual * inv, -1.0), float("-inf"))
        score_p = tl.where(in_vocab, tl.where(p > 0, p * inv, -1.0), float("-inf"))
        m_r = tl.max(score_r, 0)
        a_r = tl.argmax(score_r, 0, tie_break_left=True)
        m_p = tl.max(score_p, 0)
        a_p = tl.argmax(score_p, 0, tie_break_left=True)
        idx_r = tl.where(m_r > best_r, start + a_r.to(tl.int64), idx_r)   # strict >: an earlier tile wins ties
        best_r = tl.maximum(m_r, best_r)
        idx_p = tl.where(m_p > best_p, start + a_p.to(tl.int64), idx_p)
        best_p = tl.maximum(m_p, best_p)
    token = tl.where(best_r >= 0, idx_r, idx_p)   # a score >= 0 exists iff the residual has mass

    # 3. Output row: accepted drafts, the token, then -1 padding.
    slots = tl.arange(0, BLOCK_K)
    drafts = tl.load(D + b * k + slots, mask=slots < n_acc, other=0)
    out = tl.where(slots < n_acc, drafts, tl.where(slots == n_acc, token, -1))
    tl.store(OUT + b * (k + 1) + slots, out, mask=slots < k + 1)
    tl.store(NUM_EMITTED + b, n_acc + 1)


def verify_batch_triton(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                        num_draft: torch.Tensor, accept_u: torch.Tensor, exp_noise: torch.Tensor,
                        block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same inputs and outputs as verify.verify_batch_reference, computed by one Triton program per batch row.

    block_v: the vocabulary tile (a power of two); None picks 1024 on a GPU, a small tile under the interpreter.
    """
    p, q, d, n, u, inv_noise = _prepare_batch(target_probs, draft_probs, draft_tokens, num_draft, accept_u, exp_noise)
    try:
        check_kernel_inputs(_verify_kernel, p, q, d, n, u, inv_noise)
    except RuntimeError as e:
        raise RuntimeError(f"{e}; for verification, llmso_lab.spec.verify_batch picks the torch reference on CPU") \
            from None
    B, k1, V = p.shape
    if block_v is None:
        block_v = 1024 if p.is_cuda else min(128, triton.next_power_of_2(V))
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    out = torch.empty(B, k1, dtype=torch.int64, device=p.device)
    num_emitted = torch.empty(B, dtype=torch.int64, device=p.device)
    if B == 0:
        return out, num_emitted
    _verify_kernel[(B,)](
        p, q, d, n, u, inv_noise, out, num_emitted,
        k1 - 1, V, p.stride(0), p.stride(1), q.stride(0), q.stride(1),
        BLOCK_K=triton.next_power_of_2(k1), BLOCK_V=block_v,
    )
    return out, num_emitted
