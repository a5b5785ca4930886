"""Multi-head Latent Attention (DeepSeek-V2 §2.1), torch references: naive and weight-absorbed.

Per token MLA caches only a compressed latent `c_kv` [r] (r = kv_lora_rank) and one small RoPE key `k_pe`
[dr] shared by all heads. Head h's key and value are up-projections of the latent:
    k_h = [c_kv @ W_UK[h].T , k_pe]      (W_UK[h]: [dn, r])      v_h = c_kv @ W_UV[h].T   (W_UV[h]: [dv, r])
Naive attention forms k_h, v_h for every cached token and head. Absorption never does:
    q_h . k_h = (q_nope_h @ W_UK[h]) . c_kv + q_pe_h . k_pe       (fold W_UK into the query: [r])
    sum_s p_s v_h,s = (sum_s p_s c_kv,s) @ W_UV[h].T              (apply W_UV once, to the attended latent)
so attention runs over the latent itself: multi-query attention with key [c_kv, k_pe] (r + dr) and value c_kv
(r), one "KV head" for all query heads. RoPE must stay out of the absorbed part (a position-dependent rotation
between q and W_UK would not fold into a fixed matrix), which is why DeepSeek gives RoPE its own small key.

`mla_paged_decode_torch` is the same absorbed decode over a paged latent cache: the oracle of the Triton kernel
(`triton_mla`).

Shapes: q_nope [T, H, dn], q_pe [T, H, dr], c_kv [S, r], k_pe [S, dr], w_uk [H, dn, r], w_uv [H, dv, r];
output [T, H, dv]. `causal` aligns the T queries with the last T of the S keys (bottom-right).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _mask(T: int, S: int, causal: bool, device) -> Tensor | None:
    if not causal:
        return None
    q_pos = torch.arange(S - T, S, device=device)[:, None]
    return torch.arange(S, device=device)[None, :] <= q_pos                  # [T, S] True = visible


def mla_attention(q_nope: Tensor, q_pe: Tensor, c_kv: Tensor, k_pe: Tensor, w_uk: Tensor, w_uv: Tensor,
                  scale: float, causal: bool = True) -> Tensor:
    """Naive MLA: up-project every cached latent to per-head keys and values, then ordinary attention."""
    H = q_nope.shape[1]
    k_nope = torch.einsum("sr,hdr->hsd", c_kv, w_uk)                          # [H, S, dn]
    k = torch.cat([k_nope, k_pe[None].expand(H, -1, -1)], dim=-1)             # [H, S, dn + dr]
    v = torch.einsum("sr,hdr->hsd", c_kv, w_uv)                               # [H, S, dv]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)                      # [H, T, dn + dr]
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale,
                                       attn_mask=_mask(q.shape[1], k.shape[1], causal, q.device))
    return o[0].transpose(0, 1)                                                # [T, H, dv]


def absorb_query(q_nope: Tensor, q_pe: Tensor, w_uk: Tensor) -> Tensor:
    """[q_nope_h @ W_UK[h], q_pe_h] per head: the query of latent attention, [T, H, r + dr]."""
    return torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe], dim=-1)


def mla_decode_absorbed(q_nope: Tensor, q_pe: Tensor, c_kv: Tensor, k_pe: Tensor, w_uk: Tensor, w_uv: Tensor,
                        scale: float, causal: bool = True) -> Tensor:
    """Weight-absorbed MLA: attention over the latent cache (one shared KV head), W_UV applied afterwards.
    No per-head key or value is ever formed."""
    q = absorb_query(q_nope, q_pe, w_uk).transpose(0, 1)                       # [H, T, r + dr]
    kv = torch.cat([c_kv, k_pe], dim=-1)                                       # [S, r + dr]: what the cache holds
    o_latent = F.scaled_dot_product_attention(q[None], kv[None, None], c_kv[None, None], scale=scale,
                                              attn_mask=_mask(q.shape[1], kv.shape[0], causal, q.device))
    return torch.einsum("htr,hvr->thv", o_latent[0], w_uv)                      # [T, H, dv]


def mla_paged_decode_torch(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, latent_dim: int, scale: float) -> torch.Tensor:
    """Absorbed decode over a paged latent cache, one sequence at a time: q [B, H, r + dr] (absorbed),
    latent_cache [num_blocks, block_size, 1, r + dr] -> [B, H, r]; the oracle of `triton_mla`."""
    out = q.new_zeros(q.shape[0], q.shape[1], latent_dim)
    bs = latent_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        if n == 0:
            continue
        rows = latent_cache[block_tables[b, :math.ceil(n / bs)].long()].reshape(-1, latent_cache.shape[-1])[:n]  # [n, D]
        p = torch.softmax((q[b].float() @ rows.float().T) * scale, dim=-1)                                  # [H, n]
        out[b] = (p @ rows[:, :latent_dim].float()).to(q.dtype)
    return out
