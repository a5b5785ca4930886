"""What a simulation returns: per-request latencies, a per-step trace, and summary figures."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmso_lab.workloads import RequestMetrics, latency_summary

__all__ = ["RequestMetrics", "SimStep", "SimResult", "BUSY"]   # RequestMetrics: llmso_lab.workloads

BUSY = ("prefill", "decode")  # slot kinds that produce tokens; the rest are "idle" (held, computed for
                              # nothing: a finished row of a static batch), "stalled" (no budget) or "free"


@dataclass(slots=True)
class SimStep:
    """One engine step. `slots[i]` = (request id or None, kind) with kind in BUSY or idle/stalled/free."""

    start: float
    seconds: float
    num_prefill_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    sum_context_len: int          # KV tokens attended, summed over the step's sequences
    num_blocks_used: int
    slots: list[tuple[Any, str]]
    preempted: list[Any] = field(default_factory=list)    # (also those of steps before that ran nothing)
    prefill: dict[Any, int] = field(default_factory=dict)  # request id -> prompt tokens computed (no padding)
    swapped_in: list[Any] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs


@dataclass(slots=True)
class SimResult:
    requests: list[RequestMetrics]
    steps: list[SimStep]
    num_preemptions_total: int
    config: Any = None
    num_kv_blocks: float = math.inf   # the KV block budget used (inf: unbounded)

    @property
    def duration(self) -> float:
        """Seconds from the first arrival to the last finish."""
        return max(r.finish_time for r in self.requests) - min(r.arrival_time for r in self.requests)

    @property
    def output_throughput(self) -> float:
        """Generated tokens per second."""
        return sum(r.output_len for r in self.requests) / self.duration

    @property
    def total_throughput(self) -> float:
        """Prompt + generated tokens per second."""
        return sum(r.prompt_len + r.output_len for r in self.requests) / self.duration

    def slot_grid(self) -> np.ndarray:
        """[slots, steps] int array: the request id a slot works on in a step, -1 where it makes no token.

        Request ids must be integers (use the workload index otherwise).
        """
        grid = np.full((len(self.steps[0].slots) if self.steps else 0, len(self.steps)), -1, dtype=int)
        for j, step in enumerate(self.steps):
            for i, (rid, kind) in enumerate(step.slots):
                if kind in BUSY:
                    grid[i, j] = int(rid)
        return grid

    @property
    def slot_utilisation(self) -> float:
        """Fraction of slot-steps that produced a token (the lecture's filled cells)."""
        cells = sum(len(s.slots) for s in self.steps)
        busy = sum(kind in BUSY for s in self.steps for _, kind in s.slots)
        return busy / cells if cells else math.nan

    def summary(self) -> dict[str, Any]:
        """Throughput, TTFT/TPOT/E2E mean and percentiles (s), preemptions and utilisation."""
        return {
            "num_requests": len(self.requests),
            "duration_s": self.duration,
            "output_tokens_per_s": self.output_throughput,
            "total_tokens_per_s": self.total_throughput,
            **latency_summary(self.requests),
            "num_preemptions_total": self.num_preemptions_total,
            "num_steps": len(self.steps),
            "slot_utilisation": self.slot_utilisation,
        }
