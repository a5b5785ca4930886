"""Torch references for serving layouts: packed variable-length batches and the paged KV cache.

Varlen (continuous batching, no padding): sequences are concatenated along the token axis and
`cu_seqlens` (int32 [B+1], cumulative lengths starting at 0) says where each one starts:
q [T, H, D], k/v [T_k, Hkv, D]; sequence b owns rows cu_seqlens[b]:cu_seqlens[b+1].

Paged (vLLM's PagedAttention): K and V live in fixed-size blocks, k_cache/v_cache
[num_blocks, block_size, Hkv, D]. Sequence b's logical token t is in physical block
block_tables[b, t // block_size] at slot t % block_size; context_lens[b] tokens are valid.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .reference import naive_attention

__all__ = ["build_cu_seqlens", "varlen_attention_torch", "gather_paged_kv", "paged_attention_torch"]


def build_cu_seqlens(seq_lens: Sequence[int] | torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Cumulative sequence offsets: [3, 1, 4] -> tensor([0, 3, 4, 8], dtype=int32), shape [B+1]."""
    lens = torch.as_tensor(seq_lens, dtype=torch.int64, device=device).reshape(-1)
    assert bool((lens >= 0).all()), f"sequence lengths must be >= 0, got {lens.tolist()}"
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = torch.cumsum(lens, dim=0)
    return cu


def varlen_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor | None = None, causal: bool = True,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a packed batch, one sequence at a time.

    q [T, H, D], k/v [T_k, Hkv, D], cu_seqlens_q/cu_seqlens_k int32 [B+1] (k defaults to q's).
    Returns (o [T, H, D], lse [T, H] fp32). With causal, sequences whose q is shorter than k (a prefill
    chunk after cached tokens) are bottom-right aligned: the last query sees every key.
    """
    cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    assert cu_seqlens_q.numel() == cu_k.numel(), "cu_seqlens_q and cu_seqlens_k must have the same batch size"
    T, H, D = q.shape
    o = torch.zeros(T, H, D, dtype=q.dtype, device=q.device)
    lse = torch.full((T, H), float("-inf"), device=q.device)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_k.tolist()
    for b in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[b], bounds_q[b + 1], bounds_k[b], bounds_k[b + 1]
        assert q1 - q0 <= k1 - k0 or not causal, f"sequence {b}: {q1 - q0} queries but only {k1 - k0} keys"
        if q1 == q0:
            continue
        qb = q[q0:q1].transpose(0, 1)[None]  # [1, H, nq, D]
        kb, vb = k[k0:k1].transpose(0, 1)[None], v[k0:k1].transpose(0, 1)[None]  # [1, Hkv, nk, D]
        ob, lse_b = naive_attention(qb, kb, vb, causal=causal, scale=scale, return_lse=True)
        o[q0:q1] = ob[0].transpose(0, 1)  # [nq, H, D]
        lse[q0:q1] = lse_b[0].transpose(0, 1)  # [nq, H]
    return o, lse


def gather_paged_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Read one sequence's first `length` tokens out of a paged cache.

    cache [num_blocks, block_size, Hkv, D], block_table [max_blocks] int -> [length, Hkv, D] (contiguous).
    """
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = block_table[:num_blocks].long()  # physical block ids, in logical order
    return cache[blocks].reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor,
                          scale: float | None = None) -> torch.Tensor:
    """Decode attention over a paged KV cache: gather each sequence's blocks, then attend.

    q [B, H, D] (one query token per sequence), k_cache/v_cache [num_blocks, block_size, Hkv, D],
    block_tables int32 [B, max_blocks], context_lens int32 [B] -> o [B, H, D]. A zero-length context
    gives o = 0.
    """
    B, H, D = q.shape
    o = torch.zeros_like(q)
    for b, n in enumerate(context_lens.tolist()):
        if n == 0:
            continue
        k = gather_paged_kv(k_cache, block_tables[b], n).transpose(0, 1)[None]  # [1, Hkv, n, D]
        v = gather_paged_kv(v_cache, block_tables[b], n).transpose(0, 1)[None]
        o[b] = naive_attention(q[b][None, :, None], k, v, scale=scale)[0, :, 0]  # [H, D]
    return o
