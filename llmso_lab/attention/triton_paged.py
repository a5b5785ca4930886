"""PagedAttention decode in Triton: attention over a KV cache scattered in fixed-size blocks.

The sequence believes its keys are contiguous (logical positions 0..n-1); the kernel translates each
position through the block table, like an MMU translates virtual pages: physical block =
block_tables[b, pos // block_size], slot = pos % block_size. The block ids are loaded as integers and
used in address arithmetic, one extra small load per tile (the "indirection overhead" of the lecture).
Like FlashDecoding, the keys can be split across programs (vLLM's PagedAttention v2) and merged by lse.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .backend import check_kernel_inputs
from .triton_common import LOG2E, block_size_for, combine_splits, dot_precision, finalize_tile, online_softmax_tile
from .triton_decode import default_num_splits

__all__ = ["paged_decode_attention"]


@triton.jit
def _paged_decode_kernel(
    Q, K_cache, V_cache, K_scale, V_scale, block_tables, context_lens, O_part, LSE_part,
    stride_qb, stride_qh, stride_kblk, stride_kslot, stride_kh, stride_vblk, stride_vslot, stride_vh,
    stride_sblk, stride_sslot, stride_bt, qk_scale, num_kv_heads, group_size, head_dim, num_splits,
    PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr, INT8_KV: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bkv = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bkv // num_kv_heads).to(tl.int64)
    kvh = pid_bkv % num_kv_heads
    offs_g = tl.arange(0, BLOCK_G)  # the query heads sharing this KV head (GQA group)
    heads = kvh * group_size + offs_g
    g_mask = offs_g < group_size
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    context_len = tl.load(context_lens + b)
    split_size = tl.cdiv(context_len, num_splits)
    lo = split * split_size  # this program's logical positions [lo, hi)
    hi = tl.minimum(lo + split_size, context_len)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        pos = start_n + offs_n  # logical token positions [BLOCK_N]
        valid = pos < hi
        # Address translation: logical position -> (physical block id, slot in block).
        block_id = tl.load(block_tables + b * stride_bt + pos // PAGE_SIZE, mask=valid, other=0)  # [BLOCK_N]
        slot = pos % PAGE_SIZE
        k_rows = block_id.to(tl.int64) * stride_kblk + slot * stride_kslot + kvh * stride_kh  # [BLOCK_N]
        v_rows = block_id.to(tl.int64) * stride_vblk + slot * stride_vslot + kvh * stride_vh
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(K_cache + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        v = tl.load(V_cache + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if INT8_KV:  # int8 codes x the fp16 scale of their (token, KV head): dequantized in registers
            s_rows = block_id.to(tl.int64) * stride_sblk + slot * stride_sslot + kvh  # [BLOCK_N]
            k_s = tl.load(K_scale + s_rows, mask=valid, other=0.0).to(tl.float32)
            v_s = tl.load(V_scale + s_rows, mask=valid, other=0.0).to(tl.float32)
            k = (k.to(tl.float32) * k_s[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * v_s[:, None]).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_tile(m_i, l_i, acc, s, v, PRECISION)

    o, lse = finalize_tile(m_i, l_i, acc)  # an empty chunk (or context) gives o = 0, lse = -inf
    rows = (b * num_kv_heads * group_size + heads) * num_splits + split  # row of O_part [B*H*S, D]
    tl.store(O_part + rows[:, None] * head_dim + offs_d[None, :], o, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(LSE_part + rows, lse, mask=g_mask)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float | None = None,
                           num_splits: int | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over a paged KV cache.

    q [B, H, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D] (any block size); block_tables int32
    [B, max_blocks]; context_lens int32 [B] -> o [B, H, D]. A zero-length context gives zeros.
    num_splits: chunks of each context processed in parallel (None: from the SM count; 1 on CPU).
    k_scale/v_scale [num_blocks, block_size, Hkv] (an INT8 KV cache, `kv.quant`): the caches hold int8 codes and
    K = code * k_scale per (token, head); the kernel dequantizes what it loads.
    """
    int8_kv = k_scale is not None
    if int8_kv:
        assert k_cache.dtype == v_cache.dtype == torch.int8 and v_scale is not None, "an int8 cache needs both scales"
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride(), \
            f"scales {tuple(k_scale.shape)} must be [num_blocks, block_size, Hkv] = {tuple(k_cache.shape[:3])}"
        assert k_scale.stride(-1) == 1, "the scales' head dim must be contiguous"
    B, H, D = q.shape
    num_blocks, page_size, Hkv, Dk = k_cache.shape
    assert k_cache.shape == v_cache.shape and Dk == D, \
        f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be [num_blocks, block_size, Hkv, {D}]"
    assert H % Hkv == 0, f"{H} query heads are not a multiple of {Hkv} KV heads"
    assert block_tables.shape[0] == B and context_lens.shape == (B,), \
        f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} must have batch {B}"
    assert int8_kv or q.dtype == k_cache.dtype == v_cache.dtype, f"dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "the head dim must be contiguous"
    check_kernel_inputs(_paged_decode_kernel, q, k_cache, v_cache)
    block_tables = block_tables.to(device=q.device, dtype=torch.int32)
    context_lens = context_lens.to(device=q.device, dtype=torch.int32)
    if B * H == 0:
        return torch.empty_like(q)
    max_context = block_tables.shape[1] * page_size  # an upper bound that needs no host sync
    num_splits = default_num_splits(B * Hkv, max_context, q.device) if num_splits is None else num_splits
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    G = H // Hkv
    o_part = torch.empty(B * H * num_splits, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B * H * num_splits, dtype=torch.float32, device=q.device)
    block_n = 64 if q.is_cuda else block_size_for(triton.cdiv(max_context, num_splits), 64)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k_s, v_s = (k_scale, v_scale) if int8_kv else (k_cache, v_cache)   # unused without INT8_KV
    _paged_decode_kernel[(B * Hkv, num_splits)](
        q, k_cache, v_cache, k_s, v_s, block_tables, context_lens, o_part, lse_part,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_s.stride(0), k_s.stride(1), block_tables.stride(0),
        scale * LOG2E, Hkv, G, D, num_splits,
        PAGE_SIZE=page_size, PRECISION=dot_precision(q.dtype), INT8_KV=int8_kv,
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    return combine_splits(o_part, lse_part, B, H, num_splits, q.dtype)[0]
