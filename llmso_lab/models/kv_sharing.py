"""Store less KV across layers and across time, without training (lecture 1-2: what to store).

- Cross-layer attention (CLA, Brandon et al. 2024): groups of `share_every` adjacent layers use the K/V of the
  group's first layer; the others compute none, so the cache holds L / share_every layers.
- Sliding-window / global hybrid (Mistral, Gemma 2/3, gpt-oss): "local" layers attend to the last `window`
  tokens only, so their cache stops growing at `window` tokens; "global" layers keep everything.

`share_kv(model, share_every=2, window=1024, global_every=4)` returns a copy of a Hugging Face Llama-family model
that computes exactly that (an attention function registered with transformers reads each layer's settings),
so its perplexity on text is what the scheme costs a model that was not trained for it. `kv_bytes` gives the
cache size of a scheme at a context length.
"""
from __future__ import annotations

import copy

import torch

NAME = "llmso_kv_sharing"


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention interface: [B, H, q, D] queries, [B, Hkv, k, D] keys/values (RoPE applied, cache updated)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    stash, source = module._kv_stash, module._kv_from
    if source is None:
        stash[module.layer_idx] = (key, value)
    else:                                   # CLA: this layer's own K/V are ignored; the group's first layer's used
        key, value = stash[source]
    q_len, k_len = query.shape[2], key.shape[2]
    q_pos = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
    k_pos = torch.arange(k_len, device=query.device)[None, :]
    visible = k_pos <= q_pos
    if module._kv_window is not None:
        visible = visible & (k_pos > q_pos - module._kv_window)
    if attention_mask is not None:          # padding: HF gives a bool mask or an additive float one
        pad = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        visible = visible & pad[..., -k_len:]
    return sdpa_attention_forward(module, query, key, value, visible.expand(query.shape[0], 1, q_len, k_len),
                                  scaling=scaling, dropout=dropout, is_causal=False, **kwargs)


def layer_plan(num_layers: int, share_every: int = 1, window: int | None = None, global_every: int | None = None
               ) -> list[tuple[int | None, int | None]]:
    """Per layer: (the layer whose K/V it uses, or None for its own; its window, or None for global).
    With a window every layer is local, except, given `global_every`, the last of each group of that many."""
    if share_every < 1 or (global_every is not None and global_every < 1) or (window is not None and window < 1):
        raise ValueError("share_every and global_every must be >= 1 and window >= 1 (or None)")
    plan = []
    for i in range(num_layers):
        source = None if i % share_every == 0 else i - i % share_every
        local = window is not None and (global_every is None or i % global_every != global_every - 1)
        plan.append((source, window if local else None))
    return plan


def share_kv(model, share_every: int = 1, window: int | None = None, global_every: int | None = None):
    """A copy of `model` with cross-layer KV sharing and/or sliding-window layers (see the module doc).
    A shared layer's window is its source layer's (they share one cache)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _attention)
    out = copy.deepcopy(model)
    plan = layer_plan(len(out.model.layers), share_every, window, global_every)
    stash: dict = {}
    for i, layer in enumerate(out.model.layers):
        source, own_window = plan[i]
        a = layer.self_attn
        a._kv_stash, a._kv_from = stash, source
        a._kv_window = own_window if source is None else plan[source][1]
    out.set_attn_implementation(NAME)
    return out


def kv_bytes(num_layers: int, num_kv_heads: int, head_dim: int, context: int, bytes_per_elem: int = 2,
             share_every: int = 1, window: int | None = None, global_every: int | None = None) -> int:
    """KV-cache bytes of one sequence of `context` tokens under the scheme: the layers that own a cache, each
    holding min(context, window) tokens when local and `context` when global."""
    per_token_layer = 2 * num_kv_heads * head_dim * bytes_per_elem
    tokens = sum(context if w is None else min(context, w)
                 for src, w in layer_plan(num_layers, share_every, window, global_every) if src is None)
    return tokens * per_token_layer
