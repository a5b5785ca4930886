"""Planning prefill-decode disaggregation at scale (lecture 2-3): how many prefill and decode instances.

`best_pd_ratio` is the capacity argument in one line: a prefill instance finishes `prefill_tokens_per_s /
input_len` prompts per second, a decode instance `decode_tokens_per_s / output_len` answers per second; x prefill
and y decode instances serve min(x * the first, y * the second) requests per second.
"""
from __future__ import annotations

__all__ = ["best_pd_ratio", "pd_capacity"]


def pd_capacity(num_prefill: int, num_decode: int, input_len: int, output_len: int,
                prefill_tokens_per_s: float, decode_tokens_per_s: float) -> float:
    """Requests per second that `num_prefill` prefill and `num_decode` decode instances sustain (the slower pool)."""
    if min(input_len, output_len) <= 0 or min(prefill_tokens_per_s, decode_tokens_per_s) <= 0:
        raise ValueError("lengths and rates must be > 0")
    return min(num_prefill * prefill_tokens_per_s / input_len, num_decode * decode_tokens_per_s / output_len)


def best_pd_ratio(total_instances: int, input_len: int, output_len: int, prefill_tokens_per_s: float,
                  decode_tokens_per_s: float) -> tuple[int, int]:
    """(x, y) with x + y = total_instances, x >= 1, y >= 1, maximising `pd_capacity`; on a tie, fewer prefill
    instances. Lecture: input 4000 / output 100 wants thick prefill, input 200 / output 2000 thick decode."""
    if not isinstance(total_instances, int) or total_instances < 2:
        raise ValueError(f"total_instances must be an int >= 2 (one per pool at least), got {total_instances!r}")
    return max(((x, total_instances - x) for x in range(1, total_instances)),
               key=lambda xy: (pd_capacity(*xy, input_len, output_len, prefill_tokens_per_s, decode_tokens_per_s), -xy[0]))
