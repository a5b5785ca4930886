"""Exercise registry: what each exercise is, how many points it carries and how it is checked.

An `Exercise` names the student's function (or class, or Triton kernel) in the notebook, the library
reference it mirrors and a list of `Case`s. A case holds only inputs; the expected value is computed from the
reference (or `oracle`) in the grading process, never in the student's process.

Where cases live, and the one way to write them:
- public cases: `specs/labNN.py`, `register(Exercise(..., cases=[Case("what it checks", args, kwargs), ...]))`.
  They ship to students and `check()` runs them.
- hidden cases: `hidden/labNN.py` (instructor only; `llmso-lab release` strips the folder), one call
  `hidden("NN", {"exercise_name": [(args, kwargs), ...], ...})`. Each case uses the exercise's comparator;
  give a `Case(..., hidden=True)` instead of a tuple when one needs its own comparator or method calls.
- arguments must be plain data that survives `torch.load(weights_only=True)` (tensors, numbers, strings,
  None, lists, tuples, dicts), or instances of the few library value classes `protocol.ARGUMENT_CLASSES` lists
  (`hardware.Link`): they travel to the student's sandboxed process that way. Each call gets a deep copy, so a
  function that mutates its inputs cannot change the case for the next check.

Exercise names are unique across all labs (`register` refuses a duplicate); `get_exercise` also takes
"labNN/name". Every reference and tripwire must be something `tripwire` can disable, or `register` refuses it.
"""
from __future__ import annotations

import copy
import importlib
from functools import partial
from dataclasses import dataclass, field
from typing import Any, Callable

from llmso_lab.grading.compare import Comparator, close

__all__ = ["Case", "Exercise", "register", "hidden", "exercises", "get_exercise", "labs", "resolve", "run_case",
           "expected_value"]


@dataclass(slots=True)
class Case:
    """One check. kind="function": `target(*args, **kwargs)`. kind="class": `obj = target(*args, **kwargs)`,
    then each `(method, args, kwargs)` in `calls` is applied and the list of results is the value."""
    label: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    calls: list[tuple[str, tuple, dict]] | None = None
    compare: Comparator | None = None   # None: the exercise's comparator
    hidden: bool = False
    raises: str | None = None   # the builtin exception the reference raises here (e.g. "ValueError"): a documented
                                # error path, passed by raising that exception (or a subclass of it)


@dataclass(slots=True)
class Exercise:
    name: str                 # the function/class name the student defines in the notebook
    lab: str                  # "00", "01", ...
    points: float
    reference: str            # "module.path:attr" — the library implementation it mirrors
    cases: list[Case]
    kind: str = "function"    # "function" | "class"
    compare: Comparator = field(default_factory=close)   # for cases that do not bring their own
    timeout_s: float = 30.0   # wall-clock limit for the whole exercise (all its cases)
    memory_mb: int = 4096     # memory limit of the student's process (address space, and the job's cgroup)
    env: dict[str, str] = field(default_factory=dict)  # extra environment (e.g. TRITON_INTERPRET=1)
    description: str = ""
    oracle: str | None = None  # computes the expected values when it is not `reference` (e.g. a torch
                               # oracle for a Triton kernel, so the grader itself needs no kernel)
    tripwires: tuple[str, ...] = ()  # more library functions disabled while the exercise runs (other
                                     # implementations of the same idea that would do the work)
    triton_kernel: str | None = None  # kernel exercises: the @triton.jit function graded, launched through
    launcher: str | None = None       # `launcher(kernel, *args, **kwargs)` from the library, never the student's
    harness: str | None = None   # mechanism exercises: the library runs the student's function or class for real,
                                 # `harness(obj, *args, **kwargs)` (e.g. the engine with the student's drafter plugged
                                 # in); its expected value is the same harness run with the reference (or `oracle`).
                                 # The grader runs it in its own process on a proxy of the student's object (`judge`)

    @property
    def disabled(self) -> tuple[str, ...]:
        """Everything disabled while the exercise runs: the reference, the tripwires and the oracle (which
        computes the answer by definition), and the Triton kernels any of them launches (`tripwire.kernels_behind`)."""
        from llmso_lab.grading.tripwire import kernels_behind

        refs = tuple(dict.fromkeys((self.reference, *self.tripwires, *((self.oracle,) if self.oracle else ()))))
        return refs + tuple(kernels_behind(refs))

    @property
    def key(self) -> str:
        return f"lab{self.lab}/{self.name}"

    @property
    def graded_name(self) -> str:
        """The name the grader looks up in the exercise cell."""
        return self.triton_kernel or self.name

    def expected_target(self) -> Callable:
        """What computes the expected values, in the grading process: the oracle, else the reference (run by the
        harness where there is one)."""
        if self.oracle:
            return resolve(self.oracle)
        ref = resolve(self.reference)
        return partial(resolve(self.harness), ref) if self.harness else ref

    def comparator(self, case: Case) -> Comparator:
        return case.compare or self.compare


_REGISTRY: dict[str, dict[str, Exercise]] = {}
_LAB_OF_NAME: dict[str, str] = {}
_LOADED: set[str] = set()


def register(*exs: Exercise) -> None:
    """Add exercises. Refuses a name another exercise already has and references that cannot be disabled."""
    from llmso_lab.grading.tripwire import why_not_disableable

    for ex in exs:
        if ex.kind not in ("function", "class"):
            raise ValueError(f"exercise {ex.name}: kind must be 'function' or 'class', got {ex.kind!r}")
        if ex.name in _LAB_OF_NAME:
            raise ValueError(f"exercise name {ex.name!r} is taken by lab {_LAB_OF_NAME[ex.name]}; names are unique "
                             "across labs (check() finds exercises by name)")
        if (ex.triton_kernel is None) != (ex.launcher is None):
            raise ValueError(f"exercise {ex.name}: a Triton exercise needs both triton_kernel and launcher")
        if ex.harness and (ex.launcher or ex.kind != "function"):
            raise ValueError(f"exercise {ex.name}: a harness exercise is kind 'function' (the harness is what is "
                             "called; the student's class or function is its first argument) and has no launcher")
        if ex.harness and ex.harness in ex.disabled:
            raise ValueError(f"exercise {ex.name}: the harness {ex.harness} must not be disabled while grading")
        for ref in ex.disabled:
            if (why := why_not_disableable(ref)) is not None:
                raise ValueError(f"exercise {ex.name}: cannot disable {ref} while grading ({why})")
        _REGISTRY.setdefault(ex.lab, {})[ex.name] = ex
        _LAB_OF_NAME[ex.name] = ex.lab


def hidden(lab: str, table: dict[str, list[tuple[tuple, dict] | Case]]) -> None:
    """Append hidden cases: `{exercise name: [(args, kwargs) or Case, ...]}` (see the module docstring)."""
    for name, cases in table.items():
        ex = _REGISTRY.get(lab, {}).get(name)
        if ex is None:
            raise ValueError(f"hidden cases for {name!r}, which lab {lab} does not register")
        for i, c in enumerate(cases):
            if not isinstance(c, Case):
                args, kwargs = c
                c = Case(f"hidden {i + 1}", tuple(args), dict(kwargs))
            c.hidden = True
            ex.cases.append(c)


def _load(lab: str) -> None:
    if lab in _LOADED:
        return
    _LOADED.add(lab)
    importlib.import_module(f"llmso_lab.grading.specs.lab{lab}")
    try:  # hidden cases exist in the instructor's tree only
        importlib.import_module(f"llmso_lab.grading.hidden.lab{lab}")
    except ModuleNotFoundError as exc:
        if not exc.name or not exc.name.startswith("llmso_lab.grading.hidden"):
            raise


def labs() -> list[str]:
    """Labs that have graded exercises."""
    from importlib import resources

    names = [p.name for p in resources.files("llmso_lab.grading.specs").iterdir()]
    return sorted(n[3:5] for n in names if n.startswith("lab") and n.endswith(".py"))


def exercises(lab: str) -> list[Exercise]:
    try:
        lab = f"{int(lab):02d}"
    except (TypeError, ValueError):
        raise ValueError(f"a lab is a number like 03, got {lab!r}") from None
    if lab not in labs():
        raise ValueError(f"no graded exercises for lab {lab!r}; labs with exercises: {', '.join(labs())}")
    _load(lab)
    return list(_REGISTRY[lab].values())


def get_exercise(name: str) -> Exercise:
    """An exercise by name ("roofline_time") or by key ("lab00/roofline_time")."""
    lab_part, _, short = name.rpartition("/")
    for lab in ([lab_part.removeprefix("lab")] if lab_part else labs()):
        for ex in exercises(lab):
            if ex.name == short:
                return ex
    known = [ex.name for lab in labs() for ex in exercises(lab)]
    raise ValueError(f"unknown exercise {name!r}; known exercises: {', '.join(known)}")


def resolve(path: str) -> Any:
    """'pkg.mod:attr.sub' -> the object."""
    mod, _, attr = path.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def expected_value(oracle: Callable, case: Case, kind: str) -> Any:
    """What the oracle gives on `case`; for an error case (`case.raises`), {"raises": name, "message": text}. An
    error case the oracle does not raise on is a mistake in the spec, and says so."""
    if case.raises is None:
        return run_case(oracle, case, kind)
    try:
        value = run_case(oracle, case, kind)
    except Exception as exc:   # noqa: BLE001 - checked against the spec just below
        if case.raises not in [c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins"]:
            raise ValueError(f"case {case.label!r}: the reference raised {type(exc).__name__}, the spec says "
                             f"{case.raises}") from exc
        return {"raises": case.raises, "message": str(exc)[:300]}
    raise ValueError(f"case {case.label!r}: the spec says the reference raises {case.raises}, it returned {value!r:.80}")


def run_case(target: Callable, case: Case, kind: str) -> Any:
    """Apply one case to `target` on a deep copy of its inputs (the grader's child, check() and the
    expected values all call this)."""
    args, kwargs = copy.deepcopy(case.args), copy.deepcopy(case.kwargs)
    if kind == "function":
        return target(*args, **kwargs)
    obj = target(*args, **kwargs)
    results = []
    for method, margs, mkwargs in copy.deepcopy(case.calls) or []:
        try:
            results.append(getattr(obj, method)(*margs, **mkwargs))
        except Exception as exc:  # an expected error is part of the behaviour being checked
            results.append({"error": type(exc).__name__})
    return results
