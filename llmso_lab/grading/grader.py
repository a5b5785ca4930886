"""Grade a submitted notebook: one sandboxed child process per exercise, comparisons here.

`grade_notebook()` returns a Gradescope-style dict (`score`, `tests[]`); `llmso-lab grade` writes it as
results.json and prints a table. A crash, timeout, exit or huge allocation in one exercise costs that
exercise only.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmso_lab.grading.compare import check_plain
from llmso_lab.grading.notebook import exercise_cell_source, read_notebook
from llmso_lab.grading.registry import Exercise, exercises, resolve, run_case
from llmso_lab.grading.tripwire import MARK

__all__ = ["ExerciseResult", "grade_notebook", "grade_exercise", "expected_values", "format_table", "lab_of"]


@dataclass(slots=True)
class ExerciseResult:
    exercise: Exercise
    score: float
    passed: int
    total: int
    lines: list[str]
    seconds: float

    def as_test(self) -> dict[str, Any]:
        return {"name": self.exercise.key, "score": self.score, "max_score": float(self.exercise.points),
                "output": "\n".join(self.lines), "visibility": "visible"}


def expected_values(ex: Exercise) -> list[Any]:
    """Run the library reference on every case (in this, the grading, process)."""
    oracle = resolve(ex.oracle or ex.reference)
    return [run_case(oracle, case, ex.kind) for case in ex.cases]


def _case_label(ex: Exercise, i: int) -> str:
    case = ex.cases[i]
    return f"hidden check {i + 1}" if case.hidden else f"check {i + 1} ({case.label})"


def _run_child(ex: Exercise, source: str, timeout_s: float) -> tuple[dict | None, str]:
    """Run the exercise in a child; return (its plain-data state or None, a note on how it ended)."""
    with tempfile.TemporaryDirectory(prefix=f"llmso-grade-{ex.name}-") as job_dir:
        cases = [{"args": list(c.args), "kwargs": dict(c.kwargs),
                  "calls": [[m, list(a), dict(k)] for m, a, k in c.calls] if c.calls is not None else None}
                 for c in ex.cases]
        torch.save(cases, os.path.join(job_dir, "cases.pt"))
        job = {"exercise": ex.name, "disabled": list(ex.disabled), "kind": ex.kind, "source": source,
               "memory_mb": ex.memory_mb, "cpu_s": int(2 * timeout_s + 10)}
        Path(job_dir, "job.json").write_text(json.dumps(job))
        env = {**os.environ, **ex.env, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
        env.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
        log = open(os.path.join(job_dir, "log.txt"), "wb")
        proc = subprocess.Popen([sys.executable, "-m", "llmso_lab.grading.child", job_dir], cwd=job_dir, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
            how = "" if proc.returncode == 0 else f"the process died with exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            how = f"timed out after {timeout_s:g} s (an infinite loop, or far too slow?)"
        finally:
            try:  # kill the whole group: the child and anything it started
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            log.close()
        state = None
        out = os.path.join(job_dir, "out.pt")
        if os.path.exists(out):
            try:
                state = torch.load(out, weights_only=True)  # safe loader: plain data only
                check_plain(state, "grader state")
                if not isinstance(state, dict) or not isinstance(state.get("results"), list):
                    raise TypeError("malformed grader state")
            except Exception as exc:
                state, how = None, f"its results could not be read safely ({type(exc).__name__}: {exc})"[:500]
        if state is not None and not state.get("done") and not how:
            how = "the process stopped before finishing (did the code call os._exit()?)"
        if state is None and not how:
            how = "the process exited without returning results (did the code call os._exit()?)"
        return state, how


_FIND = object()


def grade_exercise(ex: Exercise, nb, timeout_s: float | None = None, expected: list | None = None,
                   source: str | None | object = _FIND) -> ExerciseResult:
    """Grade one exercise. `source`: its cell (None: no cell defines it), when the caller looked already."""
    t0 = time.perf_counter()
    total = len(ex.cases)
    source = exercise_cell_source(nb, ex.name) if source is _FIND else source
    if source is None:
        return ExerciseResult(ex, 0.0, 0, total, [f"no code cell defines `{ex.name}` (was the exercise cell deleted "
                                                  f"or the function renamed?)"], time.perf_counter() - t0)
    expected = expected if expected is not None else expected_values(ex)
    state, how = _run_child(ex, source, timeout_s or ex.timeout_s)
    lines, passed = [], 0
    if state and state.get("cell_error"):
        lines.append(f"the exercise cell raised while running: {state['cell_error']}")
    if state and not state.get("found"):
        lines.append(f"`{ex.name}` is not defined after running its cell")
    results = state["results"] if state else []
    reasons = []  # why each failing check failed
    for i in range(total):
        label = _case_label(ex, i)
        if i >= len(results):
            reasons.append(f"not run ({how or 'the exercise stopped early'})")
            lines.append(f"FAIL {label}: {reasons[-1]}")
            continue
        r = results[i]
        if not isinstance(r, dict) or not r.get("ok"):
            err = str(r.get("error", "")) if isinstance(r, dict) else "malformed result"
            if MARK in err:
                err = err[err.index(MARK):]
            reasons.append(err)
            lines.append(f"FAIL {label}: {err}")
            continue
        try:
            msg = ex.cases[i].compare(r["value"], expected[i])
        except Exception as exc:  # a comparator must never crash the grader
            msg = f"could not compare the result ({type(exc).__name__}: {exc})"
        if msg is None:
            passed += 1
            lines.append(f"ok   {label}")
        else:
            reasons.append("wrong result" if ex.cases[i].hidden else msg)
            lines.append(f"FAIL {label}: {reasons[-1]}")
    if how and results and len(results) >= total:
        lines.append(f"note: {how}")
    if passed == 0 and total > 1 and len(set(reasons)) == 1:
        # the same reason for every check (e.g. "not implemented yet"): say it once
        lines = [ln for ln in lines if not ln.startswith("FAIL ")] + [f"FAIL all {total} checks: {reasons[0]}"]
    score = round(ex.points * passed / total, 2) if total else 0.0
    return ExerciseResult(ex, score, passed, total, lines, time.perf_counter() - t0)


def lab_of(path: str | Path, nb=None) -> str:
    meta = (nb.metadata.get("llmso", {}) if nb is not None else {}).get("lab")
    if meta is not None:
        return f"{int(meta):02d}"
    m = re.match(r"(\d{2})_", Path(path).name)
    if not m:
        raise ValueError(f"cannot tell which lab {path} is: name it NN_topic.ipynb or pass --lab NN")
    return m.group(1)


def grade_notebook(path: str | Path, lab: str | None = None, only: list[str] | None = None,
                   timeout_s: float | None = None, exercise_list: list[Exercise] | None = None,
                   workers: int | None = None) -> dict[str, Any]:
    """Grade every exercise of the lab (or `exercise_list`); return a Gradescope results dict."""
    t0 = time.perf_counter()
    nb = read_notebook(path)
    exs = exercise_list if exercise_list is not None else exercises(lab or lab_of(path, nb))
    if only:
        exs = [e for e in exs if e.name in only]
    workers = workers or max(1, min(2, os.cpu_count() or 1))
    # Find the cells here, in one thread: CPython 3.11's ast.parse is not thread-safe ("AST constructor
    # recursion depth mismatch"). The threads below only wait on child processes.
    sources = {e.name: exercise_cell_source(nb, e.name) for e in exs}
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda e: grade_exercise(e, nb, timeout_s, source=sources[e.name]), exs))
    return {
        "score": round(sum(r.score for r in results), 2),
        "max_score": float(sum(e.points for e in exs)),
        "execution_time": round(time.perf_counter() - t0, 1),
        "output": f"Graded {Path(path).name}: {len(exs)} exercises.",
        "visibility": "visible",
        "tests": [r.as_test() for r in results],
    }


def format_table(res: dict[str, Any]) -> str:
    rows = [f"{'exercise':<40} {'score':>7} / {'max':<5}", "-" * 56]
    for t in res["tests"]:
        rows.append(f"{t['name']:<40} {t['score']:>7.2f} / {t['max_score']:<5g}")
        for ln in t["output"].splitlines():
            if not ln.startswith("ok"):
                rows.append(f"    {ln[:200]}")
    rows += ["-" * 56, f"{'total':<40} {res['score']:>7.2f} / {res['max_score']:<5g}   ({res['execution_time']} s)"]
    return "\n".join(rows)
