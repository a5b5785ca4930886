"""Which prefill worker a request goes to, or none: a short (or mostly cached) prompt is prefilled by the decode
worker itself, because moving its KV would cost more than it saves (NVIDIA Dynamo's conditional disaggregation)."""
from __future__ import annotations

from typing import Sequence

__all__ = ["LOCAL", "pd_route"]

LOCAL = -1   # prefill on the decode worker


def pd_route(num_prompt_tokens: int, num_cached_tokens: int, prefill_queue_tokens: Sequence[int],
             max_local_prefill_tokens: int = 0, max_prefill_queue_tokens: int | None = None) -> int:
    """The prefill worker for a request, or LOCAL (-1). The tokens to prefill are the prompt minus what the decode
    worker has cached. Remote only when they exceed `max_local_prefill_tokens` and the least-loaded prefill worker
    (fewest queued prompt tokens; the lowest index on ties) has fewer than `max_prefill_queue_tokens` queued
    (None: no limit); else LOCAL."""
    if not 0 <= num_cached_tokens <= num_prompt_tokens:
        raise ValueError(f"num_cached_tokens={num_cached_tokens} must lie in [0, num_prompt_tokens={num_prompt_tokens}]")
    new = num_prompt_tokens - num_cached_tokens
    if not prefill_queue_tokens or new <= max_local_prefill_tokens:
        return LOCAL
    best = min(range(len(prefill_queue_tokens)), key=lambda i: (prefill_queue_tokens[i], i))
    if max_prefill_queue_tokens is not None and prefill_queue_tokens[best] >= max_prefill_queue_tokens:
        return LOCAL
    return best
