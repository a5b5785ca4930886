"""The lecture's slot grid: 4 slots x 7 iterations, 12 of 28 cells empty under static batching.

Requests 0-3 want 7, 3, 4 and 2 output tokens (16 tokens in 28 cells). Requests 4-6 wait behind
them wanting 5, 4 and 3 tokens: continuous batching slots them into the holes as 3, 1 and 2 finish
and completes all seven in the same 7 iterations; static batching needs a second batch.
"""
from __future__ import annotations

import numpy as np

from llmso_lab.sim.cost import UnitCost
from llmso_lab.sim.simulator import simulate
from llmso_lab.workloads import Request

__all__ = ["LECTURE_OUTPUT_LENS", "LECTURE_WAITING_LENS", "lecture_requests", "lecture_slot_grids",
           "static_slot_grid", "continuous_slot_grid", "slot_utilization", "trace_slot_grid"]

LECTURE_OUTPUT_LENS = (7, 3, 4, 2)     # the first batch
LECTURE_WAITING_LENS = (5, 4, 3)       # queued behind it


def lecture_requests(with_waiting: bool = True, prompt_len: int = 8) -> list[Request]:
    """The grid's requests, all arriving at t = 0 (ids 0.. in arrival order)."""
    lens = LECTURE_OUTPUT_LENS + (LECTURE_WAITING_LENS if with_waiting else ())
    return [Request(i, 0.0, prompt_len, n) for i, n in enumerate(lens)]


def lecture_slot_grids() -> dict[str, np.ndarray]:
    """[slots, iterations] grids of request ids (-1 = slot makes no token), one step = one iteration.

    "static": the lecture's figure (the first batch alone, 4 x 7, 12 empty);
    "static_all": static batching of all seven requests (two batches);
    "continuous": continuous batching of all seven requests.
    """
    def grid(batching: str, with_waiting: bool) -> np.ndarray:
        return simulate(lecture_requests(with_waiting), UnitCost(), batching=batching, max_num_seqs=4).slot_grid()

    return {"static": grid("static", False), "static_all": grid("static", True),
            "continuous": grid("continuous", True)}


def static_slot_grid(output_lens: list[int], num_slots: int) -> np.ndarray:
    """Static batching by hand: requests in arrival order form batches of `num_slots`; a batch holds its
    slots until its longest request is done, then the next batch starts. Returns [num_slots, iterations]
    request ids, -1 where a slot makes no token (one token per busy slot per iteration)."""
    columns = []
    for first in range(0, len(output_lens), num_slots):
        batch = list(range(first, min(first + num_slots, len(output_lens))))
        for it in range(max(output_lens[r] for r in batch)):
            col = [-1] * num_slots
            for slot, rid in enumerate(batch):
                if it < output_lens[rid]:
                    col[slot] = rid
            columns.append(col)
    return np.array(columns, dtype=int).T.reshape(num_slots, len(columns))


def continuous_slot_grid(output_lens: list[int], num_slots: int) -> np.ndarray:
    """Iteration-level (continuous) batching by hand: before every iteration, waiting requests take the
    free slots (lowest slot first, in arrival order); every busy slot makes one token; a request that has
    all its tokens leaves at the end of that iteration. Returns [num_slots, iterations] request ids."""
    slots: list[int | None] = [None] * num_slots
    made = [0] * len(output_lens)
    waiting = list(range(len(output_lens)))
    columns = []
    while waiting or any(s is not None for s in slots):
        for i in range(num_slots):  # admit
            if slots[i] is None and waiting:
                slots[i] = waiting.pop(0)
        columns.append([-1 if s is None else s for s in slots])
        for i, rid in enumerate(slots):  # one token each, then retire
            if rid is not None:
                made[rid] += 1
                if made[rid] == output_lens[rid]:
                    slots[i] = None
    return np.array(columns, dtype=int).T.reshape(num_slots, len(columns))


def slot_utilization(grid: np.ndarray) -> float:
    """Busy cells / all cells of a slot grid (the lecture's 16 / 28 for static batching)."""
    grid = np.asarray(grid)
    return float((grid >= 0).sum() / grid.size) if grid.size else float("nan")


def trace_slot_grid(traces, num_slots: int | None = None) -> np.ndarray:
    """The slot grid of a real engine run, from the `StepTrace` records `LLM.step()` returns.

    A request takes the lowest free slot the first step it is scheduled and keeps it until it is retired
    (or preempted). A cell holds the request id (as an int) when the request prefilled or decoded in that
    step, -1 when the slot was empty or idle (a finished row of a static batch, still computed). Steps that
    ran no forward (they only retired requests) are skipped. Returns [num_slots, steps] ints.
    """
    holder: dict[str, int] = {}   # request id -> slot
    columns = []
    for tr in traces:
        for rid in [*tr.retired, *tr.preempted]:
            holder.pop(rid, None)
        if not tr.num_tokens:
            continue
        for rid in tr.num_tokens:   # scheduling order: running rows first, then newly admitted ones
            if rid not in holder:
                taken = set(holder.values())
                holder[rid] = next(i for i in range(len(holder) + 1) if i not in taken)
        columns.append({holder[rid]: int(rid) for rid in [*tr.prefill, *tr.decode]})
    rows = num_slots if num_slots is not None else 1 + max((s for col in columns for s in col), default=-1)
    grid = np.full((rows, len(columns)), -1, dtype=int)
    for j, col in enumerate(columns):
        for slot, rid in col.items():
            grid[slot, j] = rid
    return grid
