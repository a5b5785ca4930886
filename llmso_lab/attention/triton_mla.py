"""MLA decode in Triton: paged attention over DeepSeek's latent cache (weight-absorbed, `attention.mla`).

Each cached token is one latent row [c_kv (r), k_pe (dr)] shared by every head. One program serves ALL the
query heads of a sequence: it loads a tile of latent rows once and uses it twice, as keys (all r + dr
numbers) and as values (the first r), for every head. Compare the GQA paged kernel (`triton_paged`), which
loads K and V separately per KV head: MLA moves r + dr numbers per token where MHA moves 2 x H x head_dim.
Block tables translate positions to blocks as there. (Real kernels split the 512 + 64 latent into two tiles
instead of padding 576 to 1024; here one padded tile keeps the kernel short.)
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .backend import check_kernel_inputs
from .triton_common import LOG2E, block_size_for, combine_splits, dot_precision, finalize_tile, online_softmax_tile
from .triton_decode import default_num_splits

__all__ = ["mla_paged_decode_attention"]


@triton.jit
def _mla_decode_kernel(
    Q, Cache, block_tables, context_lens, O_part, LSE_part,
    stride_qb, stride_qh, stride_cblk, stride_cslot, stride_bt, qk_scale, num_heads, latent_dim, cache_dim,
    num_splits, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)      # every query head of this sequence
    h_mask = offs_h < num_heads
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < cache_dim
    q = tl.load(Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]: absorbed query + rope part

    context_len = tl.load(context_lens + b)
    split_size = tl.cdiv(context_len, num_splits)
    lo = split * split_size
    hi = tl.minimum(lo + split_size, context_len)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        pos = start_n + offs_n
        valid = pos < hi
        block_id = tl.load(block_tables + b * stride_bt + pos // PAGE_SIZE, mask=valid, other=0)
        rows = block_id.to(tl.int64) * stride_cblk + (pos % PAGE_SIZE) * stride_cslot   # [BLOCK_N]
        kv = tl.load(Cache + rows[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * qk_scale   # [BLOCK_H, BLOCK_N], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        v = tl.where(offs_d[None, :] < latent_dim, kv, 0.0)                 # the same tile: its c_kv part
        m_i, l_i, acc = online_softmax_tile(m_i, l_i, acc, s, v, PRECISION)

    o, lse = finalize_tile(m_i, l_i, acc)
    out_rows = (b * num_heads + offs_h) * num_splits + split
    tl.store(O_part + out_rows[:, None] * latent_dim + offs_d[None, :], o,
             mask=h_mask[:, None] & (offs_d[None, :] < latent_dim))
    tl.store(LSE_part + out_rows, lse, mask=h_mask)


def mla_paged_decode_attention(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, latent_dim: int, scale: float,
                               num_splits: int | None = None) -> torch.Tensor:
    """Absorbed MLA decode over a paged latent cache.

    q [B, H, r + dr] (query already multiplied by W_UK: `attention.mla.absorb_query`); latent_cache
    [num_blocks, block_size, 1, r + dr] ([c_kv, k_pe] per token); block_tables int32 [B, max_blocks];
    context_lens int32 [B]; latent_dim = r -> attended latent [B, H, r] (apply W_UV after).
    """
    B, H, D = q.shape
    num_blocks, page_size, one, Dc = latent_cache.shape
    assert one == 1 and Dc == D and 0 < latent_dim < D, \
        f"latent_cache {tuple(latent_cache.shape)} must be [num_blocks, block_size, 1, {D}] with latent_dim < {D}"
    assert block_tables.shape[0] == B and context_lens.shape == (B,)
    assert q.dtype == latent_cache.dtype and q.stride(-1) == 1 and latent_cache.stride(-1) == 1
    check_kernel_inputs(_mla_decode_kernel, q, latent_cache)
    block_tables = block_tables.to(device=q.device, dtype=torch.int32)
    context_lens = context_lens.to(device=q.device, dtype=torch.int32)
    if B * H == 0:
        return q.new_empty(B, H, latent_dim)
    max_context = block_tables.shape[1] * page_size
    num_splits = default_num_splits(B, max_context, q.device) if num_splits is None else num_splits
    o_part = torch.empty(B * H * num_splits, latent_dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B * H * num_splits, dtype=torch.float32, device=q.device)
    block_n = 32 if q.is_cuda else block_size_for(triton.cdiv(max_context, num_splits), 64)
    _mla_decode_kernel[(B, num_splits)](
        q, latent_cache, block_tables, context_lens, o_part, lse_part,
        q.stride(0), q.stride(1), latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        scale * LOG2E, H, latent_dim, D, num_splits,
        PAGE_SIZE=page_size, PRECISION=dot_precision(q.dtype),
        BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    return combine_splits(o_part, lse_part, B, H, num_splits, q.dtype)[0]

