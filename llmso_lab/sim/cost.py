"""Roofline cost of one engine step: how long a forward over a mixed prefill/decode batch takes.

One step reads every weight once (shared by the whole batch) plus the KV cache of each sequence,
and does 2 FLOPs per weight per token plus attention. Its time is the slower of the math and the
memory traffic (`overlap=True`, a GPU) or their sum (`overlap=False`, a CPU whose cores do both),
plus a fixed per-step overhead (scheduling, kernel launches, sampling). Units: seconds, FLOPs, bytes.

Step inputs, shared by every cost model:
  prefill: (num_new_tokens, num_cached_tokens) per sequence chunk   # tokens computed / already in KV
  decode:  context_len per decoding sequence                        # KV tokens its one new token attends
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

from llmso_lab.hardware import Accelerator
from llmso_lab.models.shapes import ModelShape

__all__ = ["CostModel", "StepCost", "StepBreakdown", "UnitCost"]

Prefill = Sequence[tuple[int, int]]


class CostModel(Protocol):
    """What the simulator needs from a cost model."""

    def step_time(self, prefill: Prefill = (), decode: Sequence[int] = ()) -> float: ...
    def swap_time(self, num_tokens: int) -> float: ...
    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int | None: ...


@dataclass(slots=True)
class UnitCost:
    """Every step takes `seconds`, swaps are free, memory is unbounded: time counts iterations."""

    seconds: float = 1.0

    def step_time(self, prefill: Prefill = (), decode: Sequence[int] = ()) -> float:
        return self.seconds if (prefill or decode) else 0.0

    def swap_time(self, num_tokens: int) -> float:
        return 0.0

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int | None:
        return None


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    flops: float
    bytes: float
    compute_s: float      # flops at the effective FLOP/s
    memory_s: float       # bytes at the effective bandwidth
    time_s: float         # the step's time, overhead included

    @property
    def intensity(self) -> float:
        """Arithmetic intensity of the step (FLOP/byte)."""
        return self.flops / self.bytes if self.bytes else math.inf

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass(slots=True)
class StepCost:
    """Roofline step time of `model` on `hardware` (see the module docstring)."""

    hardware: Accelerator
    model: ModelShape
    dtype_bytes: float = 2                 # bytes per weight (2: bf16/fp16, 4: fp32, 0.5: int4)
    kv_dtype_bytes: float | None = None    # bytes per KV element; None: same as the weights
    compute_efficiency: float = 1.0        # fraction of peak FLOP/s reached (MFU)
    bandwidth_efficiency: float = 1.0      # fraction of peak memory bandwidth reached
    overhead_s: float = 0.0                # fixed time per step
    overlap: bool = True                   # max(compute, memory) if True, else compute + memory

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(self.kv_dtype_bytes or self.dtype_bytes)

    def work(self, prefill: Prefill = (), decode: Sequence[int] = ()) -> tuple[float, float]:
        """(FLOPs, bytes) of one step. Logits are computed for one position per sequence."""
        m = self.model
        tokens = sum(n for n, _ in prefill) + len(decode)
        attn = sum(n * p + n * (n + 1) // 2 for n, p in prefill) + sum(decode)  # query-key pairs
        flops = 2 * m.body_matmul_params() * tokens + 2 * m.head_params * (len(prefill) + len(decode))
        flops += m.attention_flops(1) * attn
        kv_tokens = sum(n + p for n, p in prefill) + sum(decode)  # read the cache, write the new tokens
        nbytes = m.weight_bytes_read(tokens, self.dtype_bytes) + kv_tokens * self.kv_bytes_per_token
        return float(flops), float(nbytes)

    def count_work(self, num_prefill_tokens: int, num_decode_seqs: int, sum_context_len: int,
                   num_prefill_seqs: int | None = None) -> tuple[float, float]:
        """(FLOPs, bytes) from a step's totals, as an engine trace records them.

        `sum_context_len` sums, over the step's sequences, the KV tokens each attends to (decode:
        its length; prefill chunk: cached + new tokens). Exact for decode steps; for prefill it counts
        attention as if every new token saw the mean context (an upper bound, off by < n^2/2 pairs).
        """
        m = self.model
        seqs = num_decode_seqs + (num_prefill_seqs if num_prefill_seqs is not None else int(num_prefill_tokens > 0))
        tokens = num_prefill_tokens + num_decode_seqs
        flops = 2 * m.body_matmul_params() * tokens + 2 * m.head_params * seqs
        flops += m.attention_flops(sum_context_len) * tokens / max(seqs, 1)  # pairs ~ tokens x mean context
        nbytes = m.weight_bytes_read(tokens, self.dtype_bytes) + sum_context_len * self.kv_bytes_per_token
        return float(flops), float(nbytes)

    def time_of(self, flops: float, nbytes: float) -> float:
        """Seconds for a step doing `flops` FLOPs and moving `nbytes` bytes."""
        if flops == 0 and nbytes == 0:
            return 0.0
        c, m = self._compute_s(flops), self._memory_s(nbytes)
        return self.overhead_s + (max(c, m) if self.overlap else c + m)

    def breakdown(self, prefill: Prefill = (), decode: Sequence[int] = ()) -> StepBreakdown:
        flops, nbytes = self.work(prefill, decode)
        return StepBreakdown(flops, nbytes, self._compute_s(flops), self._memory_s(nbytes), self.time_of(flops, nbytes))

    def step_time(self, prefill: Prefill = (), decode: Sequence[int] = ()) -> float:
        """Seconds of one step over `prefill` chunks and `decode` sequences (0 for an empty step)."""
        if not prefill and not decode:
            return 0.0
        return self.time_of(*self.work(prefill, decode))

    def swap_time(self, num_tokens: int) -> float:
        """Seconds to copy `num_tokens` tokens of KV one way between device and host (PCIe)."""
        bw = self.hardware.host_bw or self.hardware.mem_bandwidth  # a CPU "swaps" within its own RAM
        return num_tokens * self.kv_bytes_per_token / bw

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int | None:
        """KV tokens that fit beside the weights; None when the hardware has no memory figure (a CPU)."""
        if not self.hardware.mem_bytes:
            return None
        budget = self.hardware.mem_bytes * gpu_memory_utilization
        tokens = self.model.max_tokens_in(budget, self.dtype_bytes, self.kv_dtype_bytes or self.dtype_bytes)
        if tokens <= 0:
            raise ValueError(
                f"{self.model.name} weights ({self.model.weight_bytes(self.dtype_bytes) / 1e9:.0f} GB) do not fit in "
                f"{gpu_memory_utilization:.0%} of {self.hardware.name} memory ({self.hardware.mem_bytes / 1e9:.0f} GB): "
                "pass num_kv_blocks=... to simulate as if they did, or use a smaller model or dtype")
        return tokens

    def _compute_s(self, flops: float) -> float:
        return flops / (self.hardware.peak_flops * self.compute_efficiency)

    def _memory_s(self, nbytes: float) -> float:
        return nbytes / (self.hardware.mem_bandwidth * self.bandwidth_efficiency)
