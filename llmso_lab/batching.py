"""Batching rules — one definition for the engine's scheduler, the simulator and the lab references.

  token budget   `prefill_chunk`: how many of a sequence's uncomputed tokens one step computes out of what is
                 left of `max_num_batched_tokens` (a chunk with chunked prefill, else the whole rest or nothing)
  decode first   `is_decode`: a sequence that computes just the token it sampled last step; these are scheduled
                 (and laid out in the batch) before prefills
  static batch   `static_batch`: how many waiting requests the next static / dynamic batch takes, and the KV
                 every row reserves: the padded rectangle [rows, longest prompt + most new tokens]

`llmso_lab.engine.Scheduler` and `llmso_lab.sim.simulate` both call these (and `llmso_lab.policies` for the
order), so that the simulator makes the engine's decisions step for step (`tests/test_sim_engine_agreement.py`).
"""
from __future__ import annotations

import math
from typing import Sequence

__all__ = ["prefill_chunk", "is_decode", "static_batch"]


def prefill_chunk(remaining: int, budget: int, enable_chunked_prefill: bool = True) -> int:
    """Tokens a sequence with `remaining` uncomputed tokens computes out of `budget` this step (0: none)."""
    if remaining <= 0 or budget <= 0:
        return 0
    if remaining <= budget:
        return remaining
    return budget if enable_chunked_prefill else 0


def is_decode(num_tokens: int, num_computed: int, num_output: int) -> bool:
    """Does a sequence of `num_tokens` tokens (prompt + `num_output` sampled), `num_computed` of them with KV,
    compute exactly its last sampled token this step? Otherwise it (re)fills a prompt: a prefill."""
    return num_output > 0 and num_computed == num_tokens - 1


def static_batch(requests: Sequence[tuple[int, int]], max_num_seqs: int, free_blocks: float, block_size: int,
                 max_model_len: int | None = None) -> tuple[int, int]:
    """The next static batch from `requests` = [(prompt tokens, max new tokens)] in serving order.

    Like Hugging Face `generate` / FasterTransformer, a batch holds a rectangular KV cache: every row reserves
    the longest prompt + the most new tokens of the batch (at most `max_model_len`), up front, so that it never
    preempts. Takes the first `max_num_seqs` requests and drops the last while the rectangle does not fit in
    `free_blocks`. Returns (rows, KV tokens reserved per row); (0, 0) when not even one row fits.
    """
    rows = min(len(requests), max_num_seqs)
    while rows:
        tokens = max(p for p, _ in requests[:rows]) + max(n for _, n in requests[:rows])
        tokens = min(tokens, max_model_len or math.inf)
        if rows * -(-tokens // block_size) <= free_blocks:
            return rows, int(tokens)
        rows -= 1
    return 0, 0
