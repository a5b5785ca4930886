"""`check("name")`: instant feedback in the notebook on an exercise's public checks.

It finds your function in the notebook's namespace, runs the public cases (in this process; the real
grader uses a sandbox), compares with the library reference and prints what passed and what failed.
"""
from __future__ import annotations

import html
import inspect
import traceback
from dataclasses import dataclass

from llmso_lab.grading.compare import check_plain
from llmso_lab.grading.registry import Exercise, get_exercise, resolve, run_case
from llmso_lab.grading.tripwire import MARK, tripwire

__all__ = ["check", "CheckResult"]


@dataclass(slots=True)
class CheckResult:
    exercise: str
    passed: int
    total: int
    lines: list[str]

    @property
    def ok(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def __repr__(self) -> str:
        head = f"{'PASSED' if self.ok else 'NOT YET'}: {self.exercise} — {self.passed}/{self.total} public checks"
        return "\n".join([head, *self.lines])

    def _repr_html_(self) -> str:
        color = "#1a7f37" if self.ok else "#cf222e"
        items = "".join(f"<li><code>{html.escape(ln)}</code></li>" for ln in self.lines)
        return (f"<div style='border-left:4px solid {color};padding-left:8px'><b style='color:{color}'>"
                f"{'PASSED' if self.ok else 'NOT YET'}</b> {html.escape(self.exercise)} — {self.passed}/{self.total} "
                f"public checks<ul>{items}</ul></div>")


def _run_one(ex: Exercise, fn, i: int) -> str | None:
    case = ex.cases[i]
    expected = run_case(resolve(ex.oracle or ex.reference), case, ex.kind)
    try:
        with tripwire(ex.disabled, ex.name):
            got = run_case(fn, case, ex.kind)
        check_plain(got)
    except NotImplementedError:
        return "not implemented yet (replace the `raise NotImplementedError` line with your code)"
    except Exception as exc:
        if MARK in str(exc):
            return str(exc)[str(exc).index(MARK):]
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return f"{type(exc).__name__}: {exc} (line {frame.lineno})"
    return case.compare(got, expected)


def check(name: str, fn=None) -> CheckResult:
    """Run the public checks of exercise `name` on your implementation (found by name in the notebook)."""
    ex = get_exercise(name)
    if fn is None:
        caller = inspect.currentframe().f_back.f_globals
        fn = caller.get(name)
    if fn is None:
        return CheckResult(name, 0, 0, [f"`{name}` is not defined: run the exercise cell first"])
    public = [i for i, c in enumerate(ex.cases) if not c.hidden]
    lines, passed = [], 0
    for i in public:
        msg = _run_one(ex, fn, i)
        passed += msg is None
        lines.append(f"ok   {ex.cases[i].label}" if msg is None else f"FAIL {ex.cases[i].label}: {msg}")
    lines.append(f"({ex.points:g} points; the grader also runs hidden checks)")
    return CheckResult(name, passed, len(public), lines)
