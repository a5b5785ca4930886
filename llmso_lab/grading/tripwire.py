"""Disable the library reference of the exercise being graded, so that calling it earns nothing.

The reference's code object is swapped in place, so every alias of it (a name imported earlier,
a method of a class, a function stored in a dict) trips too. `check()` restores it afterwards.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Iterator

from llmso_lab.grading.registry import resolve

MARK = "TRIPWIRE"


def _tripwire_code(message: str):
    src = f"def _tripwire(*args, **kwargs):\n    raise RuntimeError({message!r})\n"
    ns: dict = {}
    exec(compile(src, "<tripwire>", "exec"), ns)
    return ns["_tripwire"].__code__


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
    raise TypeError(f"cannot tripwire {obj!r}")


@contextmanager
def tripwire(reference: str, exercise: str) -> Iterator[None]:
    """While active, any call into `reference` ("module:attr") raises RuntimeError('TRIPWIRE: ...')."""
    message = (f"{MARK}: your code called {reference.replace(':', '.')}, the library's reference for exercise "
               f"'{exercise}'. It is disabled while this exercise is graded; write your own implementation.")
    code = _tripwire_code(message)
    saved = []
    for fn in _functions(resolve(reference)):
        if fn.__closure__ is None:  # a code object can only replace one with the same free variables
            saved.append((fn, fn.__code__))
            fn.__code__ = code
    try:
        yield
    finally:
        for fn, original in saved:
            fn.__code__ = original
