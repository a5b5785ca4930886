"""Lab 01 (batching) exercises and their public checks.

References: `llmso_lab.sim.grid` (the lecture's slot grids by hand) and `llmso_lab.sim.step_logic`
(steps 1-3 of the scheduler loop over plain dicts). All inputs are small literals.
"""
from typing import Any

import numpy as np
import torch

from llmso_lab.grading.compare import Comparator, exact
from llmso_lab.grading.registry import Case, Exercise, register

_same = exact()
# The simulator and the engine-trace grid draw slot grids too: off while the grid exercises are graded.
NO_SIM = ("llmso_lab.sim.simulator:simulate", "llmso_lab.sim.grid:trace_slot_grid")


def _rows(x: Any) -> Any:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return [_rows(v) for v in x]
    return x


def same_grid() -> Comparator:
    """A [slots, iterations] grid of ints, given as a list of lists, a numpy array or a tensor."""

    def cmp(got: Any, exp: Any) -> str | None:
        got, exp = _rows(got), _rows(exp)
        if not isinstance(got, list) or not all(isinstance(r, list) for r in got):
            return f"expected a list of {len(exp)} rows (one per slot), got {type(got).__name__}"
        shape = lambda g: f"{len(g)} slots x {len(g[0]) if g else 0} iterations"  # noqa: E731
        if len(got) != len(exp) or any(len(r) != len(exp[0]) for r in got):
            return f"expected {shape(exp)}, got rows of lengths {[len(r) for r in got]}"
        for i, (g, e) in enumerate(zip(got, exp)):
            if g != e:
                j = next(j for j, (a, b) in enumerate(zip(g, e)) if a != b)
                return f"slot {i}, iteration {j}: got {g[j]}, expected {e[j]} (expected row {e}, got {g})"[:300]
        return _same(got, exp)

    return cmp


grid = same_grid()


def seq(i, output_len, max_tokens, blocks, eos=False):
    """A running sequence for `retire_and_admit`."""
    return {"id": i, "output_len": output_len, "max_tokens": max_tokens, "eos": eos, "blocks": blocks}


def req(i, prompt_len):
    """A waiting request for `retire_and_admit`."""
    return {"id": i, "prompt_len": prompt_len}


register(
    Exercise("static_slot_grid", "01", 25, "llmso_lab.sim.grid:static_slot_grid", [
        Case("the lecture's batch: 7, 3, 4, 2 tokens in 4 slots", ([7, 3, 4, 2], 4)),
        Case("all seven lecture requests: two batches", ([7, 3, 4, 2, 5, 4, 3], 4)),
        Case("5 requests, 2 slots: the last batch is not full", ([2, 5, 1, 1, 3], 2)),
    ], compare=grid, tripwires=NO_SIM, description="static batching's slot grid by hand"),
    Exercise("continuous_slot_grid", "01", 35, "llmso_lab.sim.grid:continuous_slot_grid", [
        Case("all seven lecture requests in 4 slots", ([7, 3, 4, 2, 5, 4, 3], 4)),
        Case("a long request and short ones, 2 slots", ([6, 1, 2, 1, 3], 2)),
        Case("two slots free up in the same iteration", ([2, 3, 2, 1, 4, 1], 3)),
    ], compare=grid, tripwires=NO_SIM, description="iteration-level (continuous) batching's slot grid by hand"),
    Exercise("retire_and_admit", "01", 40, "llmso_lab.sim.step_logic:retire_and_admit", [
        Case("one finishes by max_tokens, one by EOS; two waiting fit",
             ([seq(0, 7, 7, 2), seq(1, 2, 9, 1, eos=True), seq(2, 3, 9, 1)], [req(3, 20), req(4, 16)], 1, 16, 4, 256)),
        Case("the free blocks stop admission",
             ([seq(0, 1, 5, 1)], [req(1, 40), req(2, 33), req(3, 8)], 4, 16, 8, 512)),
        Case("the token budget stops admission (decodes are counted first)",
             ([seq("a", 1, 5, 1), seq("b", 4, 5, 1)], [req("c", 60), req("d", 70)], 50, 16, 8, 128)),
        Case("decodes take the budget first: one decode leaves 15 of 16 tokens, so a 16-token prompt waits",
             ([seq("a", 1, 5, 1)], [req("b", 16)], 4, 16, 4, 16)),
    ], compare=_same, description="steps 1-3 of the scheduler loop: retire, count free blocks, admit FCFS"),
)
