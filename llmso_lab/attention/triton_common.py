"""Pieces shared by the Triton attention kernels: the online-softmax step and the split merge.

All kernels keep scores in *log2 units*: they multiply Q K^T by scale * log2(e) and use exp2, which is one
hardware instruction (exp(x) = exp2(x * log2(e))). lse is converted back to natural log when stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import check_kernel_inputs

__all__ = ["online_softmax_tile", "finalize_tile", "merge_splits", "combine_splits", "dot_precision",
           "block_size_for", "LOG2E"]

LOG2E = 1.4426950408889634  # log2(e)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: exact fp32 products ("ieee", not the GPU's default TF32). 16-bit inputs: the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def block_size_for(n: int, largest: int) -> int:
    """A power-of-two tile size >= 16 (tl.dot's minimum) covering n if it can, at most `largest`."""
    return max(16, min(largest, triton.next_power_of_2(max(n, 1))))


@triton.jit
def online_softmax_tile(m_i, l_i, acc, s, v, PRECISION: tl.constexpr):
    """Fold one tile of keys into the running state; the Triton twin of reference.online_softmax_update.

    m_i, l_i [M]; acc [M, D] fp32; s [M, N] scores in log2 units (masked = -inf); v [N, D].
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # row saw only masked keys: keep exp2() at 0
    alpha = tl.math.exp2(m_i - m_safe)  # [M] shrink the old state by 2^(m_old - m_new)
    p = tl.math.exp2(s - m_safe[:, None])  # [M, N] unnormalised probabilities
    l_i = l_i * alpha + tl.sum(p, 1)
    # P goes back to the input dtype so the second matmul also runs on the tensor cores.
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def finalize_tile(m_i, l_i, acc):
    """Normalise the running state: o = acc / l [M, D] and natural-log lse [M] (-inf and 0 if l == 0)."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return o, lse


@triton.jit
def _merge_splits_kernel(O_part, LSE_part, O, LSE, num_splits, head_dim,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (batch, head) row: o = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse)."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(LSE_part + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))  # [S]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (zero-length context)
    w = tl.exp(lse - m)  # [S]; an empty split has lse = -inf -> weight 0
    total = tl.sum(w, 0)
    o_ptrs = O_part + row * num_splits * head_dim + offs_s[:, None] * head_dim + offs_d[None, :]
    o_part = tl.load(o_ptrs, mask=s_mask[:, None] & (offs_d[None, :] < head_dim), other=0.0)  # [S, D]
    o = tl.sum(o_part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)  # [D]
    tl.store(O + row * head_dim + offs_d, o.to(O.dtype.element_ty), mask=offs_d < head_dim)
    lse_out = tl.where(total == 0.0, float("-inf"), m + tl.log(tl.where(total == 0.0, 1.0, total)))
    tl.store(LSE + row, lse_out)


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-split results: o_part [R, S, D] fp32, lse_part [R, S] -> (o [R, D], lse [R] fp32)."""
    R, S, D = o_part.shape
    check_kernel_inputs(_merge_splits_kernel, o_part, lse_part)
    o = torch.empty(R, D, dtype=out_dtype, device=o_part.device)
    lse = torch.empty(R, dtype=torch.float32, device=o_part.device)
    if R == 0:
        return o, lse
    _merge_splits_kernel[(R,)](o_part, lse_part, o, lse, S, D,
                               BLOCK_S=triton.next_power_of_2(S), BLOCK_D=triton.next_power_of_2(D))
    return o, lse


def combine_splits(o_part: torch.Tensor, lse_part: torch.Tensor, B: int, H: int, num_splits: int,
                   out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernels' per-split results, o_part [B*H*S, D] fp32 and lse_part [B*H*S], as (o [B, H, D],
    lse [B, H]). With one split there is nothing to merge: the single chunk is the whole answer."""
    D = o_part.shape[-1]
    if num_splits == 1:
        return o_part.view(B, H, D).to(out_dtype), lse_part.view(B, H)
    o, lse = merge_splits(o_part.view(B * H, num_splits, D), lse_part.view(B * H, num_splits), out_dtype)
    return o.view(B, H, D), lse.view(B, H)
