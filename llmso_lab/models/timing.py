"""Time real forward passes of a Hugging Face causal LM: N new tokens on top of a cached context.

Used by Lab 00 (the roofline of a real model) and the demo. Median of `reps` runs after `warmup`.
"""
from __future__ import annotations

import inspect
import statistics
import time

import torch

__all__ = ["time_forward", "cache_kwarg"]


def cache_kwarg(model) -> str:
    """Name of the KV-cache argument of `model.forward` (transformers 5.x renamed `past_key_values` to `cache`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def time_forward(model, new_tokens: int, context_len: int = 0, batch: int = 1, reps: int = 3, warmup: int = 1,
                 seed: int = 0) -> float:
    """Median seconds of one forward of `[batch, new_tokens]` tokens after a `context_len`-token KV cache."""
    from transformers import DynamicCache

    if new_tokens < 1 or batch < 1 or context_len < 0:
        raise ValueError(f"need new_tokens >= 1, batch >= 1, context_len >= 0; got {new_tokens}, {batch}, {context_len}")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(3, vocab, (batch, context_len), generator=g)
    new = torch.randint(3, vocab, (batch, new_tokens), generator=g)
    cache = DynamicCache(config=model.config)
    key = cache_kwarg(model)
    if context_len:
        model(input_ids=ctx, use_cache=True, **{key: cache})
    positions = torch.arange(context_len, context_len + new_tokens).expand(batch, -1)
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        model(input_ids=new, position_ids=positions, use_cache=True, logits_to_keep=1, **{key: cache})
        dt = time.perf_counter() - t0
        cache.crop(-new_tokens)  # drop the new tokens so every run sees the same context
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)
