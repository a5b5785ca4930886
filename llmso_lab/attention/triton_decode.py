"""FlashDecoding in Triton: split the KV sequence so that one decode token keeps the whole GPU busy.

Decode has one query token per sequence, so FlashAttention's grid (query tiles x batch x heads) has only
B * H programs: far fewer than the GPU's SMs for a small batch. FlashDecoding adds a grid axis over
chunks of the keys (splits). Each program writes a partial (o, lse) for its chunk; a second small kernel
merges them with the same rescaling rule as the online softmax (reference.merge_attention_states).

Inside a program, the G = H / Hkv query heads that share one KV head play the role FlashAttention's
query tile plays: K and V are read once per group, and tl.dot works on a [G, D] x [D, BLOCK_N] tile.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .backend import check_kernel_inputs
from .triton_common import LOG2E, block_size_for, combine_splits, dot_precision, finalize_tile, online_softmax_tile

__all__ = ["flash_decoding", "default_num_splits"]


@triton.jit
def _decode_split_kernel(
    Q, K, V, O_part, LSE_part,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    seqlen_k, split_size, qk_scale, num_kv_heads, group_size, head_dim, num_splits,
    PRECISION: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bkv = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bkv // num_kv_heads).to(tl.int64)
    kvh = pid_bkv % num_kv_heads
    offs_g = tl.arange(0, BLOCK_G)  # the query heads of this KV group (padded to >= 16 rows for tl.dot)
    heads = kvh * group_size + offs_g
    g_mask = offs_g < group_size
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = split * split_size  # this program's chunk of keys: [lo, hi); may be empty
    hi = tl.minimum(lo + split_size, seqlen_k)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < hi) & d_mask[None, :]
        k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
        s = tl.where(cols[None, :] < hi, s, float("-inf"))
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = online_softmax_tile(m_i, l_i, acc, s, v, PRECISION)

    o, lse = finalize_tile(m_i, l_i, acc)  # normalised over this chunk only; lse = -inf if it was empty
    rows = (b * num_kv_heads * group_size + heads) * num_splits + split  # row of O_part [B*H*S, D]
    tl.store(O_part + rows[:, None] * head_dim + offs_d[None, :], o, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(LSE_part + rows, lse, mask=g_mask)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_num_splits(batch_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough splits to give every SM ~2 programs, but no chunk shorter than 256 keys (1 on CPU)."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = triton.cdiv(2 * sms, max(batch_kv_heads, 1))
    return max(1, min(want, triton.cdiv(max_context, 256)))


def flash_decoding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_splits: int | None = None,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV decode attention: q [B, H, D], k/v [B, Hkv, Nk, D] -> (o [B, H, D], lse [B, H] fp32).

    num_splits: how many chunks of the keys are processed in parallel (any count; it need not divide Nk,
    and chunks beyond the keys are empty). None picks one from the GPU's SM count.
    """
    B, H, D = q.shape
    _, Hkv, Nk, Dk = k.shape
    assert k.shape == v.shape and k.shape[0] == B and Dk == D, \
        f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected [B, H, D] and [B, Hkv, N, D]"
    assert H % Hkv == 0, f"{H} query heads are not a multiple of {Hkv} KV heads"
    assert q.dtype == k.dtype == v.dtype, f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "the head dim must be contiguous"
    check_kernel_inputs(_decode_split_kernel, q, k, v)
    num_splits = default_num_splits(B * Hkv, Nk, q.device) if num_splits is None else num_splits
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    G = H // Hkv
    o_part = torch.empty(B * H * num_splits, D, dtype=torch.float32, device=q.device)  # [B*H*S, D]
    lse_part = torch.empty(B * H * num_splits, dtype=torch.float32, device=q.device)
    if B * H == 0:
        return torch.empty_like(q), torch.empty(B, H, device=q.device)
    split_size = triton.cdiv(Nk, num_splits)
    block_n = 64 if q.is_cuda else block_size_for(split_size, 64)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    _decode_split_kernel[(B * Hkv, num_splits)](
        q, k, v, o_part, lse_part, q.stride(0), q.stride(1), *k.stride()[:3], *v.stride()[:3],
        Nk, split_size, scale * LOG2E, Hkv, G, D, num_splits,
        PRECISION=dot_precision(q.dtype), BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    return combine_splits(o_part, lse_part, B, H, num_splits, q.dtype)
