"""A CPU cost profile and its calibration on measured engine steps.

On a CPU the same cores do the math and stream the weights, so the profile adds compute and memory
time instead of taking the max:  t = overhead + FLOPs / (eta_c * peak) + bytes / (eta_m * bandwidth).
That is linear in (overhead, 1/(eta_c * peak), 1/(eta_m * bandwidth)), so fitting it to measured
steps is a non-negative least-squares problem with three unknowns.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Iterable

import numpy as np

from llmso_lab.hardware import Accelerator, measure_cpu
from llmso_lab.models.shapes import SMOLLM2_135M, ModelShape
from llmso_lab.sim.cost import StepCost

__all__ = ["cpu_profile", "calibrate", "relative_errors", "as_record"]

Record = tuple[int, int, int, float]  # (num_prefill_tokens, num_decode_seqs, sum_context_len, seconds)


def cpu_profile(model: ModelShape = SMOLLM2_135M, hardware: Accelerator | None = None, dtype_bytes: float = 4,
                compute_efficiency: float = 1.0, bandwidth_efficiency: float = 1.0, overhead_s: float = 0.0) -> StepCost:
    """An uncalibrated cost model of this CPU (measured with `measure_cpu()` when `hardware` is None)."""
    return StepCost(hardware or measure_cpu(), model, dtype_bytes, None, compute_efficiency,
                    bandwidth_efficiency, overhead_s, overlap=False)


def as_record(r: Any) -> tuple[int, int, int, float, int | None]:
    """A 4-tuple, or an object with num_prefill_tokens, num_decode_seqs, sum_context_len, seconds
    (and optionally num_prefill_seqs) -> (prefill tokens, decode seqs, sum context, seconds, prefill seqs)."""
    if hasattr(r, "num_prefill_tokens"):
        return (int(r.num_prefill_tokens), int(r.num_decode_seqs), int(r.sum_context_len), float(r.seconds),
                getattr(r, "num_prefill_seqs", None))
    r = tuple(r)
    assert len(r) == 4, f"a record is (num_prefill_tokens, num_decode_seqs, sum_context_len, seconds), got {r!r}"
    return int(r[0]), int(r[1]), int(r[2]), float(r[3]), None


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0, by trying every set of free columns (fine for 3 unknowns)."""
    best, best_res = np.zeros(a.shape[1]), float(np.sum(b**2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x_sub = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if np.all(x_sub >= 0):
                x = np.zeros(a.shape[1])
                x[list(cols)] = x_sub
                res = float(np.sum((a @ x - b) ** 2))
                if res < best_res:
                    best, best_res = x, res
    return best


def calibrate(records: Iterable[Any], model: ModelShape = SMOLLM2_135M, hardware: Accelerator | None = None,
              dtype_bytes: float = 4, relative: bool = True) -> StepCost:
    """Fit a CPU profile's overhead and compute/bandwidth efficiencies to measured steps.

    records: (num_prefill_tokens, num_decode_seqs, sum_context_len, seconds) per engine step
             (see `StepCost.count_work` for what the context sum counts).
    relative: weight each step by 1/seconds, so short decode steps count as much as long prefills.
    The weight read and `overhead_s` are both paid once per step, so the data pins down their sum
    tightly; telling them apart rests on how much the KV traffic varies between steps.
    """
    base = cpu_profile(model, hardware, dtype_bytes)
    rows = [as_record(r) for r in records]
    assert len(rows) >= 3, f"need at least 3 step records to fit 3 parameters, got {len(rows)}"
    work = np.array([base.count_work(p, d, c, ps) for p, d, c, _, ps in rows])  # [N, 2] flops, bytes
    t = np.array([r[3] for r in rows])
    a = np.column_stack([np.ones(len(t)), work])                                 # [N, 3]
    w = 1.0 / t if relative else np.ones_like(t)
    scale = np.abs(a * w[:, None]).max(axis=0)  # column scaling keeps lstsq well conditioned
    scale[scale == 0] = 1.0
    x = _nnls(a * w[:, None] / scale, t * w) / scale
    overhead, s_per_flop, s_per_byte = x.tolist()
    hw = base.hardware
    base.overhead_s = overhead
    base.compute_efficiency = 1 / (s_per_flop * hw.peak_flops) if s_per_flop > 0 else math.inf
    base.bandwidth_efficiency = 1 / (s_per_byte * hw.mem_bandwidth) if s_per_byte > 0 else math.inf
    return base


def relative_errors(cost: StepCost, records: Iterable[Any]) -> np.ndarray:
    """(predicted - measured) / measured for each record."""
    rows = [as_record(r) for r in records]
    pred = np.array([cost.time_of(*cost.count_work(p, d, c, ps)) for p, d, c, _, ps in rows])
    meas = np.array([r[3] for r in rows])
    return (pred - meas) / meas
