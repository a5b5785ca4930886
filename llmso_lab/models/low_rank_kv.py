"""Low-rank KV without training: cache a latent of rank r instead of K and V (the idea behind MLA, lecture 1-2).

Each layer's stacked projection [W_k; W_v] ([2 Hkv D, hidden]) is factored by SVD, W ~ U_r S_r V_r^T: a token
would cache only c = S_r V_r^T x (r numbers) and rebuild K = U_k c, V = U_v c when attending. The model
returned here keeps HF's modules with k_proj / v_proj replaced by their rank-r products, which computes the same
attention, so its perplexity is the latent cache's perplexity. Bytes per token and layer: r instead of 2 Hkv D.

Why a Llama cannot also absorb U_k into the query the way DeepSeek does: RoPE rotates every key dimension by a
position-dependent angle AFTER W_k, so q . RoPE_p(U_k c) cannot be rewritten as (a fixed matrix applied to q) . c;
the rebuilt K must be materialised at every step. DeepSeek keeps RoPE out of the latent: a small separate
rotary key (qk_rope_head_dim) carries position, and the position-free part absorbs.
"""
from __future__ import annotations

import copy

import torch


def kv_svd(layer_attn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U [2 Hkv D, n], S [n], Vh [n, hidden] of one attention layer's stacked [W_k; W_v] (fp32)."""
    w = torch.cat([layer_attn.k_proj.weight, layer_attn.v_proj.weight]).detach().float()
    return torch.linalg.svd(w, full_matrices=False)


def low_rank_kv(model, rank: int):
    """A copy of `model` whose every layer's K and V come from a rank-`rank` latent (no training)."""
    layers = model.model.layers
    full = layers[0].self_attn.k_proj.weight.shape[0] + layers[0].self_attn.v_proj.weight.shape[0]
    if not 1 <= rank <= min(full, model.config.hidden_size):
        raise ValueError(f"rank must be in 1..{min(full, model.config.hidden_size)} (the full [W_k; W_v] rank), got {rank}")
    if any(getattr(l.self_attn.k_proj, "bias", None) is not None for l in layers):
        raise ValueError("k_proj / v_proj with a bias are not supported here (the latent would need an affine part)")
    out = copy.deepcopy(model)
    with torch.no_grad():
        for layer in out.model.layers:
            a = layer.self_attn
            U, S, Vh = kv_svd(a)
            w = (U[:, :rank] * S[:rank]) @ Vh[:rank]                  # [2 Hkv D, hidden], rank r
            nk = a.k_proj.weight.shape[0]
            a.k_proj.weight.copy_(w[:nk].to(a.k_proj.weight.dtype))
            a.v_proj.weight.copy_(w[nk:].to(a.v_proj.weight.dtype))
    return out


def energy_kept(model, rank: int) -> float:
    """Share of the squared singular values kept at `rank`, averaged over layers."""
    kept = []
    for layer in model.model.layers:
        S2 = kv_svd(layer.self_attn)[1] ** 2
        kept.append(float(S2[:rank].sum() / S2.sum()))
    return sum(kept) / len(kept)
