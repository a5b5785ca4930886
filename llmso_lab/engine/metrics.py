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
    idle: list[str] = field(default_factory=list)                 # static batching: finished rows still computed
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
