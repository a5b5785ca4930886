"""The per-step trace record of `LLM.step()` (what `viz` draws as the slot grid).

Per-request latencies are `llmso_lab.workloads.RequestMetrics`, shared with the simulator."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StepTrace:
    """What one `LLM.step()` did. Request ids are the keys."""

    step: int
    start_time: float
    wall_time_s: float = 0.0
    retired: list[str] = field(default_factory=list)              # step 1: finished requests removed
    num_free_blocks_before: int = 0                               # step 2: free KV blocks after retiring
    prefill: dict[str, int] = field(default_factory=dict)         # request -> prompt tokens computed this step
    decode: list[str] = field(default_factory=list)               # requests that decoded one token
    idle: list[str] = field(default_factory=list)                 # lock-step batches: finished rows still computed
    num_tokens: dict[str, int] = field(default_factory=dict)      # request -> tokens in the batch (incl. padding)
    num_batched_tokens: int = 0                                   # total tokens in the forward (incl. padding)
    num_padded_tokens: int = 0                                    # of which padding / idle rows
    preempted: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    num_blocks_used: int = 0                                      # after scheduling
    num_blocks_free: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0


def trace_schedule(trace: StepTrace, out, scheduler) -> tuple[int, int]:
    """Fill `trace` with what the scheduler decided this step; returns (real tokens computed, padding tokens)."""
    computed = 0
    for item in out.scheduled:
        rid = item.seq.name
        trace.num_tokens[rid] = item.num_query_tokens
        if item.idle:
            trace.idle.append(rid)
        elif item.seq.is_prefill:
            trace.prefill[rid] = item.num_new_tokens
        else:
            trace.decode.append(rid)
        trace.num_padded_tokens += item.num_query_tokens - (0 if item.idle else item.num_new_tokens)
        computed += 0 if item.idle else item.num_new_tokens
    trace.num_batched_tokens = out.num_batched_tokens
    trace.preempted = [s.name for s in out.preempted]
    trace.swapped_in = [s.name for s in out.resumed]   # (vLLM's name: resumed with their KV)
    bm = scheduler.block_manager
    trace.num_blocks_used, trace.num_blocks_free = bm.num_used_blocks, bm.num_free_blocks
    trace.num_running, trace.num_waiting = len(scheduler.running), len(scheduler.waiting)
    trace.num_swapped = len(scheduler.offloaded)
    return computed, trace.num_padded_tokens
