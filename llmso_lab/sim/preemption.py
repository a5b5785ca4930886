"""Swap or recompute? The cost of bringing a preempted sequence of L tokens back, by L.

  swap       copy its KV out to host memory and back over PCIe: 2 x L x kv_bytes / host_bw
             (+ a fixed latency per swap), paid as a stall of the step.
  recompute  drop its KV and prefill the L tokens again. A busy engine's decode step is memory-bound
             with compute to spare, so a short re-prefill rides along almost for free; only once the
             step turns compute-bound does each recomputed token cost ~2 x params / FLOP/s.

So short sequences recompute and long ones swap (lecture 1-1); the crossover sits near the length
that fills the decode step's compute slack, i.e. around the hardware's ridge point in tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from llmso_lab.sim.cost import StepCost

__all__ = ["PreemptionCosts", "preemption_costs"]


@dataclass(slots=True)
class PreemptionCosts:
    seq_lens: np.ndarray       # [N] tokens
    recompute_s: np.ndarray    # [N] extra step time of re-prefilling next to `decode_batch`
    swap_s: np.ndarray         # [N] PCIe time out and back in
    crossover_len: int | None  # shortest length from which swapping stays cheaper; None if it never does


def preemption_costs(cost: StepCost, seq_lens: Sequence[int] | None = None,
                     decode_batch: Sequence[int] = (1024,) * 32, swap_latency_s: float = 0.0) -> PreemptionCosts:
    """Recompute vs swap cost (s) for each length, on an engine already decoding `decode_batch`
    (context lengths of the running sequences; () for an idle engine)."""
    lens = np.asarray(seq_lens if seq_lens is not None else np.unique(np.geomspace(1, 32768, 200).astype(int)))
    base = cost.step_time((), decode_batch)
    recompute = np.array([cost.step_time([(int(n), 0)], decode_batch) - base for n in lens])
    swap = np.array([2 * (cost.swap_time(int(n)) + swap_latency_s) for n in lens])
    cheaper = swap < recompute
    # the crossover: first index after which swap wins at every longer length
    later_all = np.flip(np.logical_and.accumulate(np.flip(cheaper)))
    crossover = int(lens[np.argmax(later_all)]) if later_all.any() else None
    return PreemptionCosts(lens, recompute, swap, crossover)
