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

__all__ = ["LECTURE_OUTPUT_LENS", "LECTURE_WAITING_LENS", "lecture_requests", "lecture_slot_grids"]

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
