"""Change how many KV heads a real model has: MHA <-> GQA <-> MQA on Hugging Face weights (lecture 1-2).

In a Llama-family attention layer with H query heads and Hkv KV heads, query head i reads KV head
i // (H / Hkv). `k_proj` and `v_proj` weights are [Hkv * D, hidden]: one block of D rows per KV head.

- `to_gqa(model, n)`: n KV heads by mean-pooling each group of Hkv / n neighbouring KV heads (their rows of
  k_proj and v_proj, and biases): the initialisation from which Ainslie et al. (GQA, 2023) uptrain a
  multi-head checkpoint. Without that uptraining the model computes something else: perplexity rises.
  `to_mqa(model)` is `to_gqa(model, 1)`.
- `to_mha(model)`: a KV head per query head, by copying each KV head for the H / Hkv query heads that read it.
  The same function (the same logits) with H / Hkv times the KV cache.

Each returns a new model (a deep copy; the input is untouched) whose config says the new
`num_key_value_heads`, so Hugging Face `generate` and `LLM(model, tokenizer)` run it like any checkpoint.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["kv_head_counts", "mean_pool_kv_heads", "to_gqa", "to_mqa", "to_mha"]


def kv_head_counts(model) -> tuple[int, int]:
    """(query heads H, KV heads Hkv) of a Hugging Face causal LM."""
    cfg = model.config
    return cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads


def mean_pool_kv_heads(t: torch.Tensor, num_kv_heads: int, new_num_kv_heads: int) -> torch.Tensor:
    """A k_proj/v_proj weight [num_kv_heads * D, hidden] (or bias [num_kv_heads * D]) with `new_num_kv_heads` heads:
    new head j is the mean of the g = num_kv_heads / new_num_kv_heads CONSECUTIVE old heads j*g .. j*g + g - 1
    (the query heads that read them are consecutive too), computed in fp32, returned in t's dtype."""
    if new_num_kv_heads < 1 or num_kv_heads % new_num_kv_heads:
        raise ValueError(f"new_num_kv_heads={new_num_kv_heads} must divide num_kv_heads={num_kv_heads}")
    per_head = t.unflatten(0, (num_kv_heads, t.shape[0] // num_kv_heads))                   # [old, D, ...]
    pooled = per_head.float().unflatten(0, (new_num_kv_heads, num_kv_heads // new_num_kv_heads)).mean(1)
    return pooled.flatten(0, 1).to(t.dtype).contiguous()                                  # [new * D, ...]


def to_gqa(model, num_kv_heads: int):
    """A copy of `model` with `num_kv_heads` KV heads, each the mean of a group of the current ones.

    `num_kv_heads` must divide the query heads (each KV head serves a whole group of query heads) and the
    current KV heads (whole heads are averaged; to add KV heads, use `to_mha`). SmolLM2 (9 query heads,
    3 KV heads): `to_gqa(model, 1)` is MQA; `to_gqa(to_mha(model), 3)` gives the original weights back.
    """
    heads, current = kv_head_counts(model)
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be an int >= 1, got {num_kv_heads!r}")
    if heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide the {heads} query heads: each KV head serves "
                         f"an equal group of query heads (valid here: {_divisors(current)})")
    if current % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide the model's {current} KV heads: to_gqa averages "
                         f"groups of whole heads (valid here: {_divisors(current)}); to add KV heads use to_mha")
    return _with_kv_heads(model, num_kv_heads)


def to_mqa(model):
    """A copy of `model` with one KV head, the mean of all of them (multi-query attention)."""
    return to_gqa(model, 1)


def to_mha(model):
    """A copy of `model` with a KV head per query head (each KV head copied for the query heads that read it):
    identical outputs, (query heads / KV heads) times the KV cache."""
    return _with_kv_heads(model, kv_head_counts(model)[0])


def _with_kv_heads(model, num_kv_heads: int):
    heads, current = kv_head_counts(model)
    layers = getattr(getattr(model, "model", None), "layers", None)
    attns = [getattr(layer, "self_attn", None) for layer in layers or []]
    if not attns or not all(hasattr(a, "k_proj") and hasattr(a, "v_proj") for a in attns):
        raise ValueError(f"{type(model).__name__} has no Llama-style attention (model.layers[i].self_attn.k_proj / "
                         "v_proj); KV heads can be changed on Llama, Mistral, Qwen2, Mixtral and similar models")
    new = copy.deepcopy(model)
    head_dim = getattr(new.config, "head_dim", None) or new.config.hidden_size // heads
    for layer in new.model.layers:
        attn = layer.self_attn
        for proj in (attn.k_proj, attn.v_proj):
            _regroup_heads(proj, current, num_kv_heads, head_dim)
        attn.num_key_value_groups = heads // num_kv_heads   # what HF's attention uses to repeat K/V
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = num_kv_heads
    new.config.num_key_value_heads = num_kv_heads
    return new


@torch.no_grad()
def _regroup_heads(proj: nn.Linear, old: int, new: int, head_dim: int) -> None:
    """In place: `proj` (k_proj or v_proj, weight [old * D, hidden], bias [old * D]) -> [new * D, hidden].

    new <= old: head j becomes the mean of old heads j*g .. j*g + g - 1 (g = old / new), computed in fp32;
    new > old: old head j is repeated for new heads j*r .. j*r + r - 1 (r = new / old).
    """
    def regroup(t: torch.Tensor) -> torch.Tensor:
        if new <= old:
            return mean_pool_kv_heads(t, old, new)
        per_head = t.unflatten(0, (old, head_dim))                                    # [old, D, ...]
        return per_head.repeat_interleave(new // old, dim=0).flatten(0, 1).contiguous()  # [new * D, ...]

    proj.weight = nn.Parameter(regroup(proj.weight), requires_grad=proj.weight.requires_grad)
    if proj.bias is not None:
        proj.bias = nn.Parameter(regroup(proj.bias), requires_grad=proj.bias.requires_grad)
    proj.out_features = new * head_dim


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
