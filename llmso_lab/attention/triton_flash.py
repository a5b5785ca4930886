"""FlashAttention forward in Triton: dense [B, H, N, D] or packed varlen [T, H, D] batches, GQA, causal.

One program computes one BLOCK_M tile of queries for one (sequence, head). It walks the keys in BLOCK_N
tiles, keeping only the running max m, running sum l and accumulator acc on chip, so the N x N score
matrix never exists in global memory (lecture 1-2: O(N^2) -> O(N) memory, far fewer HBM bytes).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .backend import check_kernel_inputs
from .triton_common import LOG2E, block_size_for, dot_precision, finalize_tile, online_softmax_tile

__all__ = ["flash_attention"]


@triton.jit
def _flash_fwd_kernel(
    Q, K, V, O, LSE, cu_seqlens_q, cu_seqlens_k,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, qk_scale, num_heads, group_size, head_dim,
    IS_VARLEN: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_heads).to(tl.int64)
    h = pid_bh % num_heads
    kvh = h // group_size  # GQA: group_size query heads share one KV head
    if IS_VARLEN:  # this sequence's rows in the packed [T, H, D] tensors
        q_start = tl.load(cu_seqlens_q + b).to(tl.int64)
        len_q = (tl.load(cu_seqlens_q + b + 1) - q_start).to(tl.int32)
        k_start = tl.load(cu_seqlens_k + b).to(tl.int64)
        len_k = (tl.load(cu_seqlens_k + b + 1) - k_start).to(tl.int32)
    else:
        q_start, len_q = 0, seqlen_q
        k_start, len_k = 0, seqlen_k
    if pid_m * BLOCK_M >= len_q:  # grid is sized for the longest sequence; this one is shorter
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query positions in this sequence
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim  # BLOCK_D is head_dim rounded up to a power of two
    q_ptrs = Q + b * stride_qb + h * stride_qh + (q_start + offs_m[:, None]) * stride_qs + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < len_q) & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    k_base = K + b * stride_kb + kvh * stride_kh + k_start * stride_ks
    v_base = V + b * stride_vb + kvh * stride_vh + k_start * stride_vs

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    shift = len_k - len_q  # bottom-right causal: query i sees keys j <= i + shift
    hi = len_k
    if CAUSAL:  # keys right of the tile's last row are never visible: do not even load them
        hi = tl.minimum(len_k, (pid_m + 1) * BLOCK_M + shift)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n  # key positions
        kv_mask = (cols[:, None] < len_k) & d_mask[None, :]
        k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = cols[None, :] < len_k
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + shift)
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        m_i, l_i, acc = online_softmax_tile(m_i, l_i, acc, s, v, PRECISION)

    o, lse = finalize_tile(m_i, l_i, acc)
    row_mask = offs_m < len_q
    o_ptrs = O + b * stride_ob + h * stride_oh + (q_start + offs_m[:, None]) * stride_os + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    tl.store(LSE + b * stride_lb + h * stride_lh + (q_start + offs_m) * stride_ls, lse, mask=row_mask)


def _default_blocks(q: torch.Tensor, seqlen_q: int, seqlen_k: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). GPU: big tiles for the tensor cores. CPU interpreter:
    tiles no larger than the sequence, since every padded row is computed in numpy."""
    if q.is_cuda:
        return (128, 64 if head_dim <= 64 else 32, 4 if head_dim <= 64 else 8, 3)
    return block_size_for(seqlen_q, 64), block_size_for(seqlen_k, 64), 4, 1


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    cu_seqlens: torch.Tensor | None = None, *, cu_seqlens_q: torch.Tensor | None = None,
                    cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                    scale: float | None = None, block_m: int | None = None, block_n: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention forward. Returns (o, lse); lse is fp32 natural-log over the scaled scores.

    Dense: q [B, H, Nq, D], k/v [B, Hkv, Nk, D] -> o [B, H, Nq, D], lse [B, H, Nq].
    Varlen (cu_seqlens, or cu_seqlens_q + cu_seqlens_k, int32 [B+1]): q [T, H, D], k/v [T_k, Hkv, D]
    -> o [T, H, D], lse [T, H]. Causal is bottom-right aligned when a sequence has fewer queries than keys.
    """
    varlen = cu_seqlens is not None or cu_seqlens_q is not None
    if varlen:
        cu_q = cu_seqlens if cu_seqlens_q is None else cu_seqlens_q
        cu_k = cu_q if cu_seqlens_k is None else cu_seqlens_k
        assert q.dim() == 3 and k.dim() == 3, \
            f"varlen q must be [T, H, D], k [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}"
        assert cu_q.numel() == cu_k.numel(), "cu_seqlens_q and cu_seqlens_k must have the same batch size"
        cu_q, cu_k = cu_q.to(device=q.device, dtype=torch.int32), cu_k.to(device=q.device, dtype=torch.int32)
        batch, (T, H, D), Hkv = cu_q.numel() - 1, q.shape, k.shape[1]
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_q[1:] - cu_q[:-1]).max()) if batch else 0  # one host sync
        seqlen_q = seqlen_k = max_seqlen_q
        o = torch.empty_like(q)
        lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
        # Pretend the packed tensors have a batch stride of 0; rows are offset by cu_seqlens instead.
        strides = [(0, x.stride(1), x.stride(0)) for x in (q, k, v, o)] + [(0, 1, H)]
        max_k = 64 if q.is_cuda else int((cu_k[1:] - cu_k[:-1]).max()) if batch else 0  # CPU tile size only
    else:
        assert q.dim() == 4 and k.dim() == 4, \
            f"dense q must be [B, H, Nq, D], k [B, Hkv, Nk, D]; got {tuple(q.shape)}, {tuple(k.shape)}"
        (batch, H, seqlen_q, D), Hkv, seqlen_k = q.shape, k.shape[1], k.shape[2]
        cu_q = cu_k = q  # unused placeholders (IS_VARLEN=False never reads them)
        o = torch.empty_like(q)
        lse = torch.empty(batch, H, seqlen_q, dtype=torch.float32, device=q.device)
        strides = [(x.stride(0), x.stride(1), x.stride(2)) for x in (q, k, v, o)] + [lse.stride()]
        max_seqlen_q, max_k = seqlen_q, seqlen_k
    assert k.shape == v.shape and k.shape[-1] == D, f"k {tuple(k.shape)} and v {tuple(v.shape)} must match, D={D}"
    assert H % Hkv == 0, f"{H} query heads are not a multiple of {Hkv} KV heads"
    assert q.dtype == k.dtype == v.dtype, f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "the head dim must be contiguous"
    check_kernel_inputs(_flash_fwd_kernel, q, k, v)
    if batch == 0 or max_seqlen_q == 0 or H == 0:
        return o.zero_(), lse.fill_(float("-inf"))

    bm, bn, warps, stages = _default_blocks(q, max_seqlen_q, max_k, D)
    bm, bn = block_m or bm, block_n or bn
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    grid = (triton.cdiv(max_seqlen_q, bm), batch * H)
    _flash_fwd_kernel[grid](
        q, k, v, o, lse, cu_q, cu_k, *[s for st in strides for s in st],
        seqlen_q, seqlen_k, scale * LOG2E, H, H // Hkv, D,
        IS_VARLEN=varlen, CAUSAL=causal, PRECISION=dot_precision(q.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, triton.next_power_of_2(D)),
        num_warps=warps, num_stages=stages,
    )
    return o, lse
