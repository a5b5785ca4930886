"""Exercise registry: what each exercise is, how many points it carries and how it is checked.

An `Exercise` names the student's function (or class) in the notebook, the library reference it mirrors
and a list of `Case`s. A case holds only inputs; the expected value is computed from the reference in
the grading process, never in the student's process. Public cases live in `specs/labNN.py` (shipped to
students, used by `check()`); hidden cases live in `hidden/labNN.py` (instructor only, stripped from the
student bundle by `llmso-lab release`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from llmso_lab.grading.compare import Comparator, close

__all__ = ["Case", "Exercise", "register", "exercises", "get_exercise", "labs", "resolve"]


@dataclass(slots=True)
class Case:
    """One check. kind="function": `target(*args, **kwargs)`. kind="class": `obj = target(*args, **kwargs)`,
    then each `(method, args, kwargs)` in `calls` is applied and the list of results is the value."""
    label: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    calls: list[tuple[str, tuple, dict]] | None = None
    compare: Comparator = field(default_factory=close)
    hidden: bool = False


@dataclass(slots=True)
class Exercise:
    name: str                 # the function/class name the student defines in the notebook
    lab: str                  # "00", "01", ...
    points: float
    reference: str            # "module.path:attr" — the library implementation it mirrors
    cases: list[Case]
    kind: str = "function"    # "function" | "class"
    timeout_s: float = 30.0   # wall-clock limit for the whole exercise (all its cases)
    memory_mb: int = 4096     # address-space limit of the student's process
    env: dict[str, str] = field(default_factory=dict)  # extra environment (e.g. TRITON_INTERPRET=1)
    description: str = ""
    oracle: str | None = None  # computes the expected values when it is not `reference` (e.g. a torch
                               # oracle for a Triton kernel, so the grader itself needs no kernel)
    tripwires: tuple[str, ...] = ()  # more library functions disabled while the exercise runs

    @property
    def disabled(self) -> tuple[str, ...]:
        return (self.reference, *self.tripwires)

    @property
    def key(self) -> str:
        return f"lab{self.lab}/{self.name}"


_REGISTRY: dict[str, dict[str, Exercise]] = {}
_LOADED: set[str] = set()


def register(*exs: Exercise) -> None:
    for ex in exs:
        assert ex.kind in ("function", "class"), ex.kind
        _REGISTRY.setdefault(ex.lab, {})[ex.name] = ex


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
    lab = f"{int(lab):02d}"
    if lab not in labs():
        raise ValueError(f"no graded exercises for lab {lab!r}; labs with exercises: {', '.join(labs())}")
    _load(lab)
    return list(_REGISTRY[lab].values())


def get_exercise(name: str) -> Exercise:
    for lab in labs():
        for ex in exercises(lab):
            if ex.name == name:
                return ex
    known = [ex.name for lab in labs() for ex in exercises(lab)]
    raise ValueError(f"unknown exercise {name!r}; known exercises: {', '.join(known)}")


def resolve(path: str) -> Any:
    """'pkg.mod:attr' -> the object."""
    mod, _, attr = path.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def run_case(target: Callable, case: Case, kind: str) -> Any:
    """Apply one case to `target` (used identically by the grader's child, the parent and check())."""
    if kind == "function":
        return target(*case.args, **case.kwargs)
    obj = target(*case.args, **case.kwargs)
    results = []
    for method, args, kwargs in case.calls or []:
        try:
            results.append(getattr(obj, method)(*args, **kwargs))
        except Exception as exc:  # an expected error is part of the behaviour being checked
            results.append({"error": type(exc).__name__})
    return results
