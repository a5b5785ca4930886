"""Per-request latency metrics and the per-step trace record (what `viz` draws as the slot grid)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    """Times in seconds on the engine clock (`LLM.clock`, default `time.perf_counter`)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None         # when the engine retired the request and returned its output
    token_times: list[float]          # when each output token was sampled
    num_preemptions: int = 0

    @property
    def ttft(self) -> float:
        """Time to first token: arrival -> first output token."""
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float:
        return self.first_scheduled_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies between consecutive output tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float:
        """Time per output token after the first (mean inter-token latency); 0 for one-token outputs."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0

    @property
    def e2e(self) -> float:
        """End-to-end latency: arrival -> output returned."""
        return self.finish_time - self.arrival_time


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
