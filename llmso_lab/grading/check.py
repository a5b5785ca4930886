"""`check("name")`: instant feedback in the notebook on an exercise's public checks.

It finds your function (or kernel) in the notebook's namespace and runs the public cases in this process,
with the same code the grader's sandboxed child runs (`protocol.attempt`) and the same judgement
(`protocol.verdict`), so a check and the grade agree. The library reference is disabled meanwhile and
restored afterwards. Each case gets fresh copies of its inputs: a function that changes them in place
cannot change what later checks see.
"""
from __future__ import annotations

import html
import inspect
from dataclasses import dataclass
from functools import partial

from llmso_lab.grading import judge
from llmso_lab.grading.protocol import attempt, attempt_call, verdict
from llmso_lab.grading.registry import Exercise, expected_value, get_exercise, resolve
from llmso_lab.grading.remote import ChannelClosed, LocalSession
from llmso_lab.grading.tripwire import Armed, DispatcherTripwire, tripwire

__all__ = ["check", "CheckResult", "check_target", "student_or_library"]

_PASSED: dict[str, int] = {}   # exercise -> id() of the object whose public checks last all passed in this process


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


def check_target(ex: Exercise, obj):
    """(what to call, its source file) for the object the student defined; a kernel goes through the
    library's launcher, as in the grader."""
    if ex.harness is not None:   # called by the harness, through `judge.run` (see `outcome_in_process`)
        return obj, _source_file(obj)
    if ex.launcher is None:
        return obj, _source_file(obj)
    code = getattr(getattr(obj, "fn", None), "__code__", None)
    if not callable(getattr(obj, "run", None)) or code is None:
        raise TypeError(f"`{ex.graded_name}` must be a @triton.jit kernel")
    return partial(resolve(ex.launcher), obj), code.co_filename


def _source_file(obj) -> str | None:
    """The file a function (or the first method of a class) was defined in."""
    code = getattr(obj, "__code__", None)
    if code is None and isinstance(obj, type):
        code = next((f.__code__ for f in vars(obj).values() if hasattr(f, "__code__")), None)
    return getattr(code, "co_filename", None)


def spec_functions() -> list[str]:
    """Every function of the loaded spec modules: the grader's job has none of them (their oracles and case
    helpers compute answers), so here they are disabled too while the student's code runs."""
    import sys

    refs = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("llmso_lab.grading.specs.") and mod is not None:
            refs += [f"{name}:{attr}" for attr, fn in vars(mod).items()
                     if inspect.isfunction(fn) and fn.__module__ == name and "<locals>" not in fn.__qualname__]
    return refs


def _disabled(ex: Exercise) -> tuple[str, ...]:
    return tuple(dict.fromkeys((*ex.disabled, *spec_functions())))


def outcome_in_process(ex: Exercise, obj, index: int) -> dict:
    """Run case `index` on the student's object here, references disabled (what the grader's child does). A mechanism
    exercise runs as in the grader: its harness through `judge.outcome`, the student's object served by the grader's
    own child code (`remote.LocalSession`), the tripwires armed only while the student's code runs."""
    target, source_file = check_target(ex, obj)
    if ex.harness is not None:
        with DispatcherTripwire(ex.disabled, ex.key) as watch:
            arm = Armed(_disabled(ex), ex.key)

            def run(thunk, raw=False):
                with arm:
                    out = attempt_call(thunk, source_file, raw=raw, catch_interrupt=False)
                return out if watch.intact() else {"ok": False, "category": "tripwire", "error": watch.broken_message()}

            try:
                return judge.outcome(ex, LocalSession(target, run), ex.cases[index])
            except ChannelClosed as closed:
                return {"ok": False, "category": "error", "error": f"stopped: {closed}"}
    with tripwire(_disabled(ex), ex.key), DispatcherTripwire(ex.disabled, ex.key) as watch:
        outcome = attempt(target, ex.cases[index], ex.kind, source_file, catch_interrupt=False)
        if not watch.intact():
            return {"ok": False, "category": "tripwire", "error": watch.broken_message()}
        return outcome


def check(name: str, fn=None) -> CheckResult:
    """Run the public checks of exercise `name` on your implementation (found by name in the notebook)."""
    ex = get_exercise(name)
    if fn is None:
        fn = inspect.currentframe().f_back.f_globals.get(ex.graded_name)
    if fn is None:
        return CheckResult(ex.name, 0, 0, [f"`{ex.graded_name}` is not defined: run the exercise cell first"])
    try:
        check_target(ex, fn)
    except TypeError as exc:
        return CheckResult(ex.name, 0, 0, [str(exc)])
    oracle = ex.expected_target()
    lines, passed, public = [], 0, [i for i, c in enumerate(ex.cases) if not c.hidden]
    for i in public:
        expected = expected_value(oracle, ex.cases[i], ex.kind)
        msg = verdict(ex, ex.cases[i], outcome_in_process(ex, fn, i), expected)
        passed += msg is None
        lines.append(f"ok   {ex.cases[i].label}" if msg is None else f"FAIL {ex.cases[i].label}: {msg}")
    lines.append(f"({ex.points:g} points; the grader also runs hidden checks)")
    result = CheckResult(ex.name, passed, len(public), lines)
    if result.ok:
        _PASSED[ex.name] = id(fn)
    else:
        _PASSED.pop(ex.name, None)
    return result


def student_or_library(name: str, obj=None):
    """What a lab's experiment runs for exercise `name`: your implementation when its public checks pass, otherwise
    the library's reference, so that a student who is stuck can still run the rest of the lab. Prints one line saying
    which ran (never silently).

    `obj` defaults to the notebook's definition of the exercise (found by name, as `check` does). "Passes" means
    `check(name)` passed on this very object in this session; when it has not been run on it, it runs here, quietly.
    Grading is unaffected: the grader runs only the exercise cells, with the library's reference disabled."""
    ex = get_exercise(name)
    if obj is None:
        obj = inspect.currentframe().f_back.f_globals.get(ex.graded_name)
    if obj is not None and _PASSED.get(ex.name) != id(obj):
        check(name, obj)
    if obj is not None and _PASSED.get(ex.name) == id(obj):
        print(f"[{ex.name}] your implementation runs here (its public checks pass)")
        return check_target(ex, obj)[0]   # a kernel comes back launched the way the reference is called
    # what answers the exercise's own call: its oracle where the exercise has one (computed by definition, with the
    # exercise's signature), else the reference; a kernel or a harnessed object: the reference (the library's kernel,
    # the library's class or function that the harness plugs in)
    stand_in = ex.oracle if ex.oracle and ex.harness is None and ex.launcher is None else ex.reference
    why = "is not defined yet" if obj is None else "does not pass its public checks yet"
    print(f"[{ex.name}] your `{ex.graded_name}` {why}: this experiment runs the library's version "
          f"`{stand_in.replace(':', '.')}` instead (run check({name!r}) to see what is missing)")
    return resolve(stand_in)
