"""Time real forward passes of a Hugging Face causal LM: N new tokens on top of a cached context.

Used by Lab 00 (the roofline of a real model), Lab 01 (does an idle row cost time? where does the engine's time go?)
and the demo.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sys
import time
from typing import Callable, Sequence

import torch

__all__ = ["time_forwards", "cache_kwarg", "op_seconds", "quiet_c_stderr"]


@contextlib.contextmanager
def quiet_c_stderr():
    """torch's profiler logs two USDT lines per run straight to the C-level stderr: hide them."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def op_seconds(fn: Callable[[], object]) -> tuple[object, dict[str, float]]:
    """Run `fn` under torch.profiler (CPU ops): (its result, {operator name: self CPU seconds}). Self time counts each
    op once (not the ops it calls), so the values add up to the profiled ops' share of the wall time; the profiler
    adds a little to every op."""
    from torch.profiler import ProfilerActivity, profile

    with quiet_c_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}


def cache_kwarg(model) -> str:
    """Name of the KV-cache argument of `model.forward` (transformers 5.x renamed `past_key_values` to `cache`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def time_forwards(model, shapes: Sequence[tuple[int, int]], context_len: int = 0, rounds: int = 3, warmup: int = 1,
                  seed: int = 0) -> list[float]:
    """Seconds of one forward of `[batch, new_tokens]` tokens after a `context_len`-token KV cache, for each
    `(new_tokens, batch)` in `shapes`: the best of `rounds` runs (the least disturbed one).

    The shapes take turns, round after round, so a burst of work from another process slows one run of
    several shapes instead of every run of one shape. Logits are computed for the last position only, as in
    a prefill.
    """
    from transformers import DynamicCache

    if any(n < 1 or b < 1 for n, b in shapes) or context_len < 0 or rounds < 1:
        raise ValueError(f"need new_tokens >= 1, batch >= 1, context_len >= 0, rounds >= 1; got {shapes}, "
                         f"{context_len}, {rounds}")
    vocab, key = model.config.vocab_size, cache_kwarg(model)
    g = torch.Generator().manual_seed(seed)
    caches = {}
    for b in sorted({b for _, b in shapes}):  # one cache per batch size, filled with the same context once
        caches[b] = DynamicCache(config=model.config)
        if context_len:
            model(input_ids=torch.randint(3, vocab, (b, context_len), generator=g), use_cache=True, **{key: caches[b]})
    inputs = [torch.randint(3, vocab, (b, n), generator=g) for n, b in shapes]
    best = [float("inf")] * len(shapes)
    for r in range(warmup + rounds):
        for i, ((n, b), ids) in enumerate(zip(shapes, inputs)):
            positions = torch.arange(context_len, context_len + n).expand(b, -1)
            t0 = time.perf_counter()
            model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **{key: caches[b]})
            dt = time.perf_counter() - t0
            caches[b].crop(-n)  # drop the new tokens: every run sees the same context
            if r >= warmup:
                best[i] = min(best[i], dt)
    return best
