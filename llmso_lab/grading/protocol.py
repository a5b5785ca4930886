"""What crosses between the grader and the student's process, and how an outcome becomes a verdict.

`check()` (in the notebook) and the grader's child both run a case with `attempt()`; both judge it with
`verdict()`. So `check()` and the grade agree by construction.

Messages are length-prefixed `torch.save` payloads over pipes, read back with `torch.load(weights_only=True)`
(plain data only, nothing executable) and refused above `MAX_MESSAGE` bytes; the cases the grader sends may
also hold the library value classes of `ARGUMENT_CLASSES`, what the student's process sends back may not. The
grader sends one case at a time, public cases first, and sends the next only after the previous result came
back: the student's process never holds a list of the hidden cases.
"""
from __future__ import annotations

import builtins
import io
import os
import select
import struct
import time
import traceback
from typing import Any, Callable, Sequence

import torch

from llmso_lab.grading.compare import guard, to_plain
from llmso_lab.grading.registry import Case, Exercise, resolve, run_case

MAX_MESSAGE = 64 * 2**20
# Library classes a case argument may hold besides plain data: frozen dataclasses of names and numbers, which an
# exercise takes as they are (Lab 08's `allreduce_time(nbytes, n, link)` reads `link.bandwidth`). Only the student's
# side loads them, from the grader; the grader reads a student's results as plain data only.
ARGUMENT_CLASSES = ("llmso_lab.hardware:Link",)
_HEADER = struct.Struct(">Q")

# Hidden checks report only these fixed reasons: nothing the student's code says reaches the student.
HIDDEN_REASONS = {
    "not_implemented": "not implemented yet",
    "exit": "the code called sys.exit() or os._exit()",
    "memory": "ran out of memory",
    "tripwire": "called a library function that is disabled for this exercise",
    "type": "returned something that is not plain data (tensors, numbers, strings, lists, dicts)",
    "error": "raised an exception (details are not shown for hidden checks)",
    "wrong": "wrong result",
    "size": "the result is far larger than expected",
    "no_error": "returned a result where the docstring says to raise an error",
    "other_error": "raised a different kind of exception than the docstring says",
}


# ---- framing -------------------------------------------------------------------------------------
def _wait(fd: int, deadline: float, write: bool) -> bool:
    """Is `fd` ready before the deadline (inf: wait as long as it takes)?"""
    left = None if deadline == float("inf") else deadline - time.monotonic()
    if left is not None and left <= 0:
        return False
    ready = select.select([], [fd], [], left) if write else select.select([fd], [], [], left)
    return bool(ready[1] if write else ready[0])


def send(fd: int, obj: Any, deadline: float = float("inf")) -> None:
    """Write one message. On a non-blocking fd (the grader's side) a reader that stops reading raises
    TimeoutError at the deadline instead of blocking the grader."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    view = memoryview(_HEADER.pack(len(buf.getbuffer())) + buf.getvalue())
    while view:
        if not _wait(fd, deadline, write=True):
            raise TimeoutError
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue


def _read_exactly(fd: int, n: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        if not _wait(fd, deadline, write=False):
            raise TimeoutError
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def argument_classes() -> list[type]:
    """The classes of `ARGUMENT_CLASSES` (for `recv(..., classes=...)` on the student's side)."""
    return [resolve(path) for path in ARGUMENT_CLASSES]


def recv(fd: int, deadline: float = float("inf"), limit: int = MAX_MESSAGE, classes: Sequence[type] = ()) -> Any:
    """One message. Raises TimeoutError (deadline passed), EOFError (the other side closed) or ValueError
    (too large, or not plain data). `classes`: library classes allowed besides plain data (`argument_classes`)."""
    (n,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    if n > limit:
        raise ValueError(f"the result is too large to read back ({n / 2**20:.0f} MB; the limit is {limit / 2**20:.0f} MB)")
    try:
        with torch.serialization.safe_globals(list(classes)):
            return torch.load(io.BytesIO(_read_exactly(fd, n, deadline)), weights_only=True)
    except (EOFError, TimeoutError):
        raise
    except Exception as exc:   # not loadable as plain data
        raise ValueError(f"its result could not be read safely ({type(exc).__name__})") from None


# ---- running one case ------------------------------------------------------------------------------
def describe(exc: BaseException, source_file: str | None) -> dict[str, str]:
    """{"error": a message for the student, "category": one of HIDDEN_REASONS}; lines are those of the cell."""
    from llmso_lab.grading.tripwire import MARK

    if isinstance(exc, SystemExit):
        return {"category": "exit", "error": f"the code called sys.exit({exc.code!r}); exercises must return a value"}
    if isinstance(exc, NotImplementedError):
        return {"category": "not_implemented",
                "error": "not implemented yet (replace the `raise NotImplementedError` line with your code)"}
    if isinstance(exc, MemoryError):
        return {"category": "memory", "error": "ran out of memory (is something allocating far too much?)"}
    try:
        text = str(exc)
    except Exception:   # an exception whose __str__ fails
        text = "(unprintable)"
    if MARK in text:
        return {"category": "tripwire", "error": text[text.index(MARK):][:600]}
    # the builtin exception classes it is an instance of: a cell's own class named "ValueError" is not one (its
    # __module__ can read "builtins" when the cell runs without a __name__, so the class itself is compared)
    raised = [c.__name__ for c in type(exc).__mro__ if getattr(builtins, c.__name__, None) is c]
    frames = [fr for fr in traceback.extract_tb(exc.__traceback__) if source_file and fr.filename == source_file]
    at = f" at line {frames[-1].lineno} of the exercise cell" if frames else ""
    msg = f"{type(exc).__name__}{at}: {text}"
    if isinstance(exc, NameError):
        msg += " (exercise cells are graded on their own: import or define what they use inside the cell)"
    return {"category": "error", "error": msg[:2000], "raised": raised}


def attempt(target: Callable, case: Case, kind: str, source_file: str | None, *, catch_interrupt: bool = True) -> dict:
    """Run one case: {"ok": True, "value": plain data} or {"ok": False, "error": ..., "category": ...}."""
    return attempt_call(lambda: run_case(target, case, kind), source_file, catch_interrupt=catch_interrupt)


def attempt_call(thunk: Callable[[], Any], source_file: str | None, *, catch_interrupt: bool = True,
                 raw: bool = False) -> dict:
    """Run student code: {"ok": True, "value": its result as plain data (raw: as it is)} or {"ok": False, ...}."""
    try:
        value = thunk()
    except KeyboardInterrupt:
        if not catch_interrupt:
            raise
        return {"ok": False, "category": "error", "error": "interrupted"}
    except BaseException as exc:  # SystemExit included: report and carry on with the next case
        return {"ok": False, **describe(exc, source_file)}
    if raw:
        return {"ok": True, "value": value}
    try:
        return {"ok": True, "value": to_plain(value)}
    except TypeError as exc:
        return {"ok": False, "category": "type", "error": str(exc)}
    except (RuntimeError, MemoryError) as exc:   # e.g. copying a huge stride-0 view runs out of memory
        return {"ok": False, "category": "memory", "error": f"the result could not be copied ({type(exc).__name__})"}


def verdict(ex: Exercise, case: Case, outcome: Any, expected: Any) -> str | None:
    """None when the case passes, else why not (generic for hidden cases)."""
    if not isinstance(outcome, dict) or not isinstance(outcome.get("ok"), bool):
        return "malformed result"
    if case.raises is not None:
        return _error_verdict(case, outcome, expected)
    if not outcome["ok"]:
        category = outcome.get("category") if outcome.get("category") in HIDDEN_REASONS else "error"
        return HIDDEN_REASONS[category] if case.hidden else str(outcome.get("error", ""))[:2000]
    got = outcome.get("value")
    if (msg := guard(got, expected)) is not None:
        return HIDDEN_REASONS["size"] if case.hidden else msg
    try:
        msg = ex.comparator(case)(got, expected)
    except Exception as exc:  # a comparator must never crash the grader
        msg = f"could not compare the result ({type(exc).__name__}: {exc})"[:500]
    if msg is None:
        return None
    return HIDDEN_REASONS["wrong"] if case.hidden else msg


def _error_verdict(case: Case, outcome: dict, expected: dict) -> str | None:
    """A documented error path: passed when the code raised `case.raises` (or a subclass)."""
    if outcome["ok"]:
        return HIDDEN_REASONS["no_error"] if case.hidden else (
            f"expected {case.raises} for these inputs (the docstring asks for it; the reference says: "
            f"{expected.get('message', '')!r}), got a result")
    category = outcome.get("category")
    if category in ("not_implemented", "exit", "memory", "tripwire"):
        return HIDDEN_REASONS[category] if case.hidden else str(outcome.get("error", ""))[:2000]
    raised = outcome.get("raised")
    if isinstance(raised, list) and case.raises in raised:
        return None
    return HIDDEN_REASONS["other_error"] if case.hidden else (
        f"expected {case.raises}, got {str(outcome.get('error', ''))[:300]}")
