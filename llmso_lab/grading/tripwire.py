"""Disable the library references of the exercise being graded, so that calling them earns nothing.

A Python function's code object is swapped in place, so every alias of it (a name imported earlier, a
method of a class, a function stored in a dict) trips too. Anything else (a builtin such as torch's SDPA)
is replaced by name in its module. `check()` restores everything afterwards; the grader's child never does.
"""
from __future__ import annotations

import importlib
import inspect
from contextlib import contextmanager
from typing import Iterator, Sequence

from llmso_lab.grading.registry import resolve

MARK = "TRIPWIRE"


def _tripwire_function(message: str):
    src = f"def _tripwire(*args, **kwargs):\n    raise RuntimeError({message!r})\n"
    ns: dict = {}
    exec(compile(src, "<tripwire>", "exec"), ns)
    return ns["_tripwire"]


def _functions(obj) -> list:
    if inspect.isfunction(obj):
        return [obj]
    if inspect.isclass(obj):
        fns = []
        for v in vars(obj).values():
            v = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
            v = v.fget if isinstance(v, property) else v
            if inspect.isfunction(v):
                fns.append(v)
        return fns
    return []


@contextmanager
def tripwire(references: str | Sequence[str], exercise: str) -> Iterator[None]:
    """While active, any call into `references` ("module:attr") raises RuntimeError('TRIPWIRE: ...')."""
    saved_code, saved_attr = [], []
    for ref in [references] if isinstance(references, str) else references:
        message = (f"{MARK}: your code called {ref.replace(':', '.')}, which is disabled while exercise "
                   f"'{exercise}' is graded (it would do the exercise for you); write your own implementation.")
        trip = _tripwire_function(message)
        obj = resolve(ref)
        fns = _functions(obj)
        for fn in fns:
            if fn.__closure__ is None:  # a code object can only replace one with the same free variables
                saved_code.append((fn, fn.__code__))
                fn.__code__ = trip.__code__
        if not fns:  # a builtin or C function: replace it by name in its module
            mod, _, attr = ref.partition(":")
            owner = importlib.import_module(mod)
            saved_attr.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, trip)
    try:
        yield
    finally:
        for fn, original in saved_code:
            fn.__code__ = original
        for owner, attr, original in saved_attr:
            setattr(owner, attr, original)
