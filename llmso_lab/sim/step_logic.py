"""Steps 1-3 of the lecture's scheduler loop in miniature, over plain dicts (Lab 01's reference).

    1. retire sequences that hit EOS or max_tokens in the previous step; their KV blocks go back;
    2. count the free blocks;
    3. admit waiting requests, first come first served, while a slot, the token budget and the blocks last;
    4. (the forward; not here) the batch is the surviving sequences (one decode token each) + the admitted
       prompts.

This is what `llmso_lab.engine.Scheduler` does under continuous batching with chunked prefill off and
no preemption: decodes take the token budget first (one token each), then a waiting request is admitted
only if its whole prompt fits the rest of the budget (`llmso_lab.batching.prefill_chunk`, the rule the
engine and the simulator use) and its prompt's blocks fit the free blocks. FCFS
stops at the first request that does not fit; it never lets a later, smaller one jump ahead. Growing a
running sequence's blocks and preempting when they run out are left to Lab 02.
"""
from __future__ import annotations

from typing import Any, Sequence

from llmso_lab.batching import prefill_chunk

__all__ = ["retire_and_admit"]


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)   # ceil


def retire_and_admit(running: Sequence[dict], waiting: Sequence[dict], free_blocks: int, block_size: int,
                     max_num_seqs: int, max_num_batched_tokens: int) -> dict[str, Any]:
    """One scheduler step's bookkeeping.

    running: dicts {"id", "output_len", "max_tokens", "eos", "blocks"}, in running order: tokens made so
        far, the request's limit, whether its last token was EOS (with ignore_eos off), KV blocks held.
    waiting: dicts {"id", "prompt_len"} in arrival order; admitting one takes ceil(prompt_len / block_size)
        blocks and prompt_len tokens of the budget.
    free_blocks: free KV blocks before retiring. You may assume max_num_batched_tokens >= max_num_seqs
    and len(running) <= max_num_seqs.

    Returns {"retired": ids retired (running order), "free_blocks": free blocks after retiring (step 2),
    "admitted": ids admitted (arrival order), "running": ids in the next batch (survivors, then admitted),
    "num_batched_tokens": tokens in the next forward, "free_blocks_left": free blocks after admitting}.
    """
    retired = [s["id"] for s in running if s["eos"] or s["output_len"] >= s["max_tokens"]]
    survivors = [s["id"] for s in running if s["id"] not in retired]
    free = free_blocks + sum(s["blocks"] for s in running if s["id"] in retired)
    counted = free
    budget = max_num_batched_tokens - len(survivors)        # decodes first: one token each
    assert budget >= 0, "max_num_batched_tokens must cover one decode token per running sequence"
    admitted = []
    for req in waiting:
        need = _blocks_for(req["prompt_len"], block_size)
        whole = prefill_chunk(req["prompt_len"], budget, enable_chunked_prefill=False) == req["prompt_len"]
        if len(survivors) + len(admitted) >= max_num_seqs or not whole or need > free:
            break                                           # FCFS: nobody overtakes the head of the queue
        admitted.append(req["id"])
        budget -= req["prompt_len"]
        free -= need
    return {"retired": retired, "free_blocks": counted, "admitted": admitted, "running": survivors + admitted,
            "num_batched_tokens": max_num_batched_tokens - budget, "free_blocks_left": free}
