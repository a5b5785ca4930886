"""The decode-first token budget of one continuous-batching step (vLLM's `max_num_batched_tokens`).

Every step may compute at most `max_num_batched_tokens` tokens for at most `max_num_seqs` sequences:

  1. every running decode takes exactly 1 token, in queue order;
  2. what is left goes to prefills in queue order: with chunked prefill a prompt takes as much of the
     leftover as it needs (a chunk; the rest waits for the next step), without it the whole remaining
     prompt must fit or it gets nothing;
  3. the first prefill that gets nothing stops the queue (no skipping ahead: FCFS order is kept).

Rule 2 is `prefill_chunk` (its home is `llmso_lab.batching`, re-exported here): the planner below, the
simulator and the engine's scheduler all call it. The engine and the simulator interleave it with KV blocks
and preemption; `plan_token_budget` is the budget alone, for one step's queues.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from llmso_lab.batching import prefill_chunk

__all__ = ["prefill_chunk", "plan_token_budget"]


def plan_token_budget(decodes: Sequence[Hashable], prefills: Sequence[tuple[Hashable, int]],
                      max_num_batched_tokens: int, max_num_seqs: int = 256,
                      enable_chunked_prefill: bool = True) -> list[tuple[Hashable, int]]:
    """One step's plan: [(request_id, num_tokens), ...] in scheduling order (decodes first).

    decodes:  ids of running sequences that decode (1 token each), in queue order
    prefills: (id, uncomputed prompt tokens) of prefilling / waiting sequences, in queue order
    """
    plan: list[tuple[Hashable, int]] = []
    budget = max_num_batched_tokens
    for rid in decodes:
        if budget == 0 or len(plan) == max_num_seqs:
            return plan
        plan.append((rid, 1))
        budget -= 1
    for rid, remaining in prefills:
        n = prefill_chunk(remaining, budget, enable_chunked_prefill) if len(plan) < max_num_seqs else 0
        if n == 0:
            break
        plan.append((rid, n))
        budget -= n
    assert sum(n for _, n in plan) <= max_num_batched_tokens and len(plan) <= max_num_seqs
    return plan
