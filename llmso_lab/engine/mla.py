"""The engine's MLA layers (DeepSeek-V2/V3 attention) over a latent paged cache.

Per token and layer the cache holds `[c_kv, k_pe]` (kv_lora_rank + qk_rope_head_dim numbers) in ONE tensor
`[num_blocks + 1, block_size, 1, r + dr]`; the value is its first r numbers (a view, never stored twice). The
attention backends see multi-query attention over it: query [q_nope_h @ W_UK[h], q_pe_h] per head, one KV head
(`llmso_lab.attention.mla` explains the absorption). Prefill and decode both run absorbed; W_UV is applied
to the attended latent, then o_proj. Math follows Hugging Face's DeepseekV3Attention (interleaved RoPE on the
small rotary part, RMSNorm on the latent, its softmax scale).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llmso_lab.attention.mla import absorb_query


@dataclass(slots=True)
class MLAWeights:
    q: Tensor | None            # [hidden, H * (dn + dr)] (models without a query LoRA)
    q_a: Tensor | None          # [hidden, q_lora_rank] ...
    q_a_norm: Tensor | None
    q_a_eps: float
    q_b: Tensor | None          # ... [q_lora_rank, H * (dn + dr)]
    kv_a: Tensor                # [hidden, r + dr]: the latent and the rotary key, one matmul
    kv_a_norm: Tensor           # [r]
    kv_a_eps: float
    w_uk: Tensor                # [H, dn, r]: folded into the query
    w_uv: Tensor                # [H, dv, r]: applied to the attended latent
    o: Tensor                   # [H * dv, hidden]
    scale: float                # softmax scale: HF's (qk_nope + qk_rope)^-0.5, not (r + dr)^-0.5


@dataclass(slots=True)
class MLAShape:
    num_heads: int
    nope_dim: int       # dn
    rope_dim: int       # dr
    v_dim: int          # dv
    latent_dim: int     # r = kv_lora_rank
    interleave: bool    # DeepSeek's interleaved RoPE pairs

    @classmethod
    def from_config(cls, cfg) -> MLAShape:
        return cls(cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                   cfg.kv_lora_rank, bool(getattr(cfg, "rope_interleave", False)))

    @property
    def cache_dim(self) -> int:
        return self.latent_dim + self.rope_dim


def load_mla(attn, shape: MLAShape, dtype: torch.dtype, t) -> MLAWeights:
    """Weights of one HF DeepseekV3Attention; `t` turns an nn.Linear weight [out, in] into [in, out] in dtype."""
    H, dn, dv, r = shape.num_heads, shape.nope_dim, shape.v_dim, shape.latent_dim
    kv_b = attn.kv_b_proj.weight.detach().view(H, dn + dv, r)
    lora = attn.q_a_proj is not None
    return MLAWeights(
        q=None if lora else t(attn.q_proj.weight, dtype), q_a=t(attn.q_a_proj.weight, dtype) if lora else None,
        q_a_norm=attn.q_a_layernorm.weight.detach().to(dtype) if lora else None,
        q_a_eps=attn.q_a_layernorm.variance_epsilon if lora else 0.0,
        q_b=t(attn.q_b_proj.weight, dtype) if lora else None,
        kv_a=t(attn.kv_a_proj_with_mqa.weight, dtype), kv_a_norm=attn.kv_a_layernorm.weight.detach().to(dtype),
        kv_a_eps=attn.kv_a_layernorm.variance_epsilon,
        w_uk=kv_b[:, :dn].to(dtype).contiguous(), w_uv=kv_b[:, dn:].to(dtype).contiguous(),
        o=t(attn.o_proj.weight, dtype), scale=float(attn.scaling))


def rope_interleaved(x: Tensor, cos_half: Tensor, sin_half: Tensor) -> Tensor:
    """HF's `apply_rotary_pos_emb_interleave` for x [T, heads, dr], cos/sin_half [T, 1, dr/2]: pairs (x0, x1),
    (x2, x3), ... each rotated by one frequency, output laid out as [rotated evens, rotated odds]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos_half - x2 * sin_half, x2 * cos_half + x1 * sin_half], dim=-1)


def mla_layer(x: Tensor, w: MLAWeights, shape: MLAShape, backend, k_cache: Tensor, v_cache: Tensor, meta,
              cos: Tensor, sin: Tensor, rms_norm, apply_rope) -> Tensor:
    """x [T, hidden] (after the input RMSNorm) -> the attention block's output [T, hidden].
    cos/sin [T, 1, dr] as the model runner keeps them (sin signed for `apply_rope`)."""
    T, H, dn, dr, r = x.shape[0], shape.num_heads, shape.nope_dim, shape.rope_dim, shape.latent_dim
    q = x @ w.q if w.q is not None else rms_norm(x @ w.q_a, w.q_a_norm, w.q_a_eps) @ w.q_b
    q = q.view(T, H, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    latent = x @ w.kv_a                                                   # [T, r + dr]
    c_kv = rms_norm(latent[:, :r], w.kv_a_norm, w.kv_a_eps)               # [T, r]
    k_pe = latent[:, None, r:]                                            # [T, 1, dr]
    if shape.interleave:
        half = dr // 2
        cos_h, sin_h = cos[..., :half], sin[..., half:]                   # the table is cat(f, f); sin unsigned there
        q_pe, k_pe = rope_interleaved(q_pe, cos_h, sin_h), rope_interleaved(k_pe, cos_h, sin_h)
    else:
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)
    query = absorb_query(q_nope, q_pe, w.w_uk)                             # [T, H, r + dr]
    key = torch.cat([c_kv[:, None], k_pe], dim=-1)                        # [T, 1, r + dr]: what the cache stores
    backend.store_kvcache(key, None, k_cache, v_cache, meta.slot_mapping)
    o_latent = backend.forward(query, key, key[..., :r], k_cache, v_cache, meta, None)   # [T, H, r]
    out = torch.einsum("thr,hvr->thv", o_latent, w.w_uv)                  # [T, H, dv]
    return out.reshape(T, H * shape.v_dim) @ w.o
