"""The student's side of grading: `python -m llmso_lab.grading.child JOB_DIR`.

Runs in its own process group, in a fresh temp dir, under address-space/CPU/file-size rlimits. It
executes ONE exercise cell, calls the student's code on the inputs in `cases.pt`, and writes only plain
data to `out.pt` after every case. It never sees expected values; the grader compares and scores.
Functions that start processes (the parallelism lab) work the same way: their children inherit the
rlimits and the process group, and the grader kills the whole group on timeout.
"""
from __future__ import annotations

import json
import os
import sys
import traceback


def _limit(memory_mb: int, cpu_s: int) -> None:
    try:
        import resource
    except ImportError:  # not on Linux/macOS: wall-clock timeout only
        return
    for res, val in ((resource.RLIMIT_AS, memory_mb * 2**20), (resource.RLIMIT_CPU, cpu_s),
                     (resource.RLIMIT_FSIZE, 512 * 2**20), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(res, (val, val))
        except (ValueError, OSError):
            pass


PRELUDE = """\
import math, random, itertools, functools, collections
from dataclasses import dataclass, field
from typing import *
import numpy as np
import torch
import torch.nn.functional as F
try:
    import triton
    import triton.language as tl
except Exception:
    pass
"""


def main(job_dir: str) -> None:
    with open(os.path.join(job_dir, "job.json")) as f:
        job = json.load(f)
    _limit(job["memory_mb"], job["cpu_s"])
    import linecache

    import torch

    torch.set_num_threads(1)
    from llmso_lab.grading.registry import Case, run_case
    from llmso_lab.grading.tripwire import tripwire

    out_path = os.path.join(job_dir, "out.pt")
    state = {"cell_error": None, "found": False, "results": [], "done": False}

    def save() -> None:
        tmp = out_path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, out_path)

    cases = torch.load(os.path.join(job_dir, "cases.pt"), weights_only=True)
    tw = tripwire(job["disabled"], job["exercise"])
    tw.__enter__()  # never undone: this process only ever runs student code from here on
    ns: dict = {"__name__": "__main__"}
    exec(compile(PRELUDE, "<prelude>", "exec"), ns)
    # Give the cell a real file so inspect.getsource works (Triton's @jit needs it).
    cell_file = os.path.join(job_dir, "exercise_cell.py")
    with open(cell_file, "w") as f:
        f.write(job["source"])
    linecache.cache[cell_file] = (len(job["source"]), None, job["source"].splitlines(True), cell_file)
    try:
        exec(compile(job["source"], cell_file, "exec"), ns)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt included: report and carry on
        state["cell_error"] = _describe(exc, cell_file)
    target = ns.get(job["exercise"])
    state["found"] = target is not None
    if target is None:
        state["done"] = True
        save()
        return
    save()
    for spec in cases:
        case = Case(label="", args=tuple(spec["args"]), kwargs=dict(spec["kwargs"]),
                    calls=[(m, tuple(a), dict(k)) for m, a, k in spec["calls"]] if spec["calls"] is not None else None)
        try:
            value = _plain(run_case(target, case, job["kind"]))
            state["results"].append({"ok": True, "value": value, "error": ""})
        except BaseException as exc:
            state["results"].append({"ok": False, "value": None, "error": _describe(exc, cell_file)})
        save()
    state["done"] = True
    save()


def _describe(exc: BaseException, cell_file: str) -> str:
    if isinstance(exc, SystemExit):
        return f"the code called sys.exit({exc.code!r}); exercises must return a value instead"
    if isinstance(exc, NotImplementedError):
        return f"not implemented yet ({exc})"
    if isinstance(exc, MemoryError):
        return "ran out of memory (the grader limits memory; is something allocating far too much?)"
    tb = traceback.extract_tb(exc.__traceback__)
    where = [f"line {fr.lineno}" for fr in tb if fr.filename == cell_file]
    at = f" at {where[-1]} of the exercise cell" if where else ""
    msg = f"{type(exc).__name__}{at}: {exc}"
    if isinstance(exc, NameError):
        msg += " (exercise cells are graded on their own: import or define what they use inside the cell)"
    return msg[:2000]


def _plain(obj, depth: int = 0):
    """Convert a student's result to plain data, refusing anything else."""
    import numpy as np
    import torch

    if depth > 20:
        raise TypeError("the result is nested too deeply")
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().as_subclass(torch.Tensor).clone()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.array(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if type(obj) in (int, float, bool, str, type(None)):
        return obj
    if type(obj) in (list, tuple):
        return type(obj)(_plain(x, depth + 1) for x in obj)
    if type(obj) is dict:
        return {k: _plain(v, depth + 1) for k, v in obj.items() if type(k) in (str, int)}
    raise TypeError(f"returned a {type(obj).__name__}; return tensors, numbers, strings, lists or dicts")


if __name__ == "__main__":
    main(sys.argv[1])
