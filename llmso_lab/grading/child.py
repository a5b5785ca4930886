"""The student's side of grading: `python -m llmso_lab.grading.child` (cwd: the job's work dir).

Runs in the sandbox (`sandbox.py`) against the student bundle's copy of the library, in which the exercise's
references are stubs (`tripwire.stub_package`). It executes ONE exercise cell, then answers the grader's
cases one at a time over two pipes (`protocol.py`). It never sees expected values nor a list of the hidden
cases; the grader compares and scores. A mechanism exercise (`Exercise.harness`) is served instead of called: its
harness runs in the grader and every call it makes on the student's object arrives here as a message
(`remote.serve`); the answers are plain data.
"""
from __future__ import annotations

import json
import linecache
import os
import re

PRELUDE = """\
import math, random, itertools, functools, collections
from dataclasses import dataclass, field
from typing import *
import numpy as np
import torch
import torch.nn.functional as F
"""
TRITON_PRELUDE = """\
try:
    import triton
    import triton.language as tl
except Exception:
    pass
"""


def prelude(job: dict) -> str:
    """The names every exercise cell gets; triton and tl only where the cell can use them (importing triton
    costs a second or two per exercise)."""
    wants_triton = job["launcher"] or re.search(r"\b(triton|tl)\b", job["source"])
    return PRELUDE + (TRITON_PRELUDE if wants_triton else "")


def _limit(rlimits: dict[str, int]) -> None:
    """Reduced sandbox only (the isolated one sets these before exec)."""
    try:
        import resource
    except ImportError:  # not on Linux/macOS: wall-clock timeout only
        return
    for name, value in rlimits.items():
        try:
            resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, value))
        except (ValueError, OSError, AttributeError):
            pass


def _target(job: dict, ns: dict, cell_file: str):
    """(callable to grade, None) or (None, why not)."""
    from functools import partial

    from llmso_lab.grading.registry import resolve

    name = job["graded_name"]
    obj = ns.get(name)
    if obj is None:
        return None, f"`{name}` is not defined after running its cell"
    if job.get("harness"):   # a mechanism exercise: the grader runs the harness and calls this object (`remote`)
        return obj, None
    if not job["launcher"]:
        return obj, None
    # A Triton exercise: the student's kernel, launched by the library's launcher (a fixed grid), so the
    # result is whatever the kernel computes and nothing else the cell might do.
    code = getattr(getattr(obj, "fn", None), "__code__", None)
    if not callable(getattr(obj, "run", None)) or code is None or code.co_filename != cell_file:
        return None, f"`{name}` must be the @triton.jit kernel defined in the exercise cell"
    return partial(resolve(job["launcher"]), obj), None


def main() -> None:
    with open("job.json") as f:
        job = json.load(f)
    rfd, wfd = (int(x) for x in os.environ.pop("LLMSO_GRADE_FDS").split(","))
    if job.get("rlimits"):
        _limit(job["rlimits"])
    import torch

    torch.set_num_threads(1)
    from llmso_lab.grading.protocol import argument_classes, attempt, attempt_call, describe, recv, send
    from llmso_lab.grading.registry import Case
    from llmso_lab.grading.remote import serve
    from llmso_lab.grading.tripwire import DispatcherTripwire, disable

    disable(job["runtime_tripwires"], job["exercise"])   # builtins; library references are stubs already
    watch = DispatcherTripwire(job["operator_tripwires"], job["exercise"]).install()   # their aten operators
    ns: dict = {"__name__": "__main__"}
    exec(compile(prelude(job), "<prelude>", "exec"), ns)
    # Give the cell a real file so inspect.getsource works (Triton's @jit needs it).
    cell_file = os.path.abspath("exercise_cell.py")
    with open(cell_file, "w") as f:
        f.write(job["source"])
    linecache.cache[cell_file] = (len(job["source"]), None, job["source"].splitlines(True), cell_file)
    cell_error = None
    try:
        exec(compile(job["source"], cell_file, "exec"), ns)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt included: report and carry on
        cell_error = describe(exc, cell_file)["error"]
    target, problem = _target(job, ns, cell_file)
    send(wfd, {"cell_error": cell_error, "problem": problem})
    if target is None:
        return
    classes = argument_classes()   # e.g. hardware.Link: case arguments that are not plain data
    # the cell itself may have removed the dispatcher tripwire
    broken = watch.broken_message() if not watch.intact() else None
    if job.get("harness"):   # the harness runs in the grader: answer its calls on the student's object
        def run(thunk, raw=False):
            nonlocal broken
            outcome = attempt_call(thunk, cell_file, raw=raw)
            if not broken and not watch.intact():   # once removed or patched, no later call counts either
                broken = watch.broken_message()
            return {"ok": False, "category": "tripwire", "error": broken} if broken else outcome
        return serve(target, lambda m: send(wfd, m), lambda: recv(rfd, classes=classes), run)
    while True:
        try:
            msg = recv(rfd, classes=classes)
        except EOFError:
            return
        if msg.get("done"):
            return
        calls = [(m, tuple(a), dict(k)) for m, a, k in msg["calls"]] if msg["calls"] is not None else None
        case = Case("", tuple(msg["args"]), dict(msg["kwargs"]), calls=calls)
        outcome = attempt(target, case, job["kind"], cell_file)
        if not broken and not watch.intact():   # once removed or patched, no later case counts either
            broken = watch.broken_message()
        send(wfd, {"ok": False, "category": "tripwire", "error": broken} if broken else outcome)


if __name__ == "__main__":
    main()
