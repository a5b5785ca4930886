"""Moving a prompt's KV cache from the prefill worker to the decode worker: how many bytes, and how much of the
transfer time the decode side actually waits for (lecture 2-3).

    bytes = 2 x layers x kv_heads x head_dim x dtype_bytes x (prompt tokens - tokens the decode side has cached)

Sent whole after the prefill, the transfer adds its full time to TTFT. Sent layer by layer, layer i's KV travels
while layer i + 1 computes, so only what the link has not finished when the last layer is done is exposed.
"""
from __future__ import annotations

from typing import Sequence

from llmso_lab.hardware import kv_cache_bytes_of_config

__all__ = ["kv_transfer_bytes", "exposed_transfer_time", "transfer_timeline"]


def kv_transfer_bytes(config: dict, num_prompt_tokens: int, num_cached_tokens: int = 0, dtype_bytes: float = 2) -> int:
    """Bytes the prefill worker sends for one request: the KV of every prompt token the decode worker does not
    already hold (its prefix cache: `num_cached_tokens`), for a model given by its Hugging Face config dict
    (MLA configs send their latent cache: `hardware.kv_cache_bytes_of_config`)."""
    if not 0 <= num_cached_tokens <= num_prompt_tokens:
        raise ValueError(f"num_cached_tokens={num_cached_tokens} must lie in [0, num_prompt_tokens={num_prompt_tokens}]")
    return kv_cache_bytes_of_config(config, num_prompt_tokens - num_cached_tokens, dtype_bytes=dtype_bytes)


def transfer_timeline(compute_s: Sequence[float], transfer_s: Sequence[float], layerwise: bool = True
                      ) -> list[tuple[float, float]]:
    """(start, end) of each layer's transfer, time 0 = the prefill starts. Layer i computes for compute_s[i]
    (layers back to back); one link carries one layer at a time, in order. layerwise=False: every transfer
    waits for the last layer (the whole cache is sent after the prefill)."""
    if len(compute_s) != len(transfer_s) or not compute_s:
        raise ValueError(f"give one compute and one transfer time per layer (got {len(compute_s)} and {len(transfer_s)})")
    if min(compute_s) < 0 or min(transfer_s) < 0:
        raise ValueError("times must be >= 0")
    done, clock, link_free, spans = 0.0, 0.0, 0.0, []
    total = sum(compute_s)
    for c, t in zip(compute_s, transfer_s):
        clock += c                                   # layer i's KV is in the cache now
        start = max(link_free, clock if layerwise else total)
        link_free = start + t
        spans.append((start, link_free))
    return spans


def exposed_transfer_time(compute_s: Sequence[float], transfer_s: Sequence[float], layerwise: bool = True) -> float:
    """Seconds the decode side waits after the prefill's last layer is done until the whole KV has arrived.
    Without layer-wise sending: the sum of the transfers. With it: at least the last layer's transfer, more when
    the link is slower than the compute and a backlog builds up."""
    return transfer_timeline(compute_s, transfer_s, layerwise)[-1][1] - sum(compute_s)
