"""Notebook helpers: find the cell that defines an exercise, and turn solution cells into student stubs.

Markers (nbgrader style), in code cells:
    ### BEGIN SOLUTION / ### END SOLUTION          -> replaced by `raise NotImplementedError("exercise NAME")`
    ### BEGIN HIDDEN TESTS / ### END HIDDEN TESTS  -> removed
and in markdown cells `### BEGIN SOLUTION` ... `### END SOLUTION` -> "*Your answer here.*".
Cells tagged `instructor-only` are dropped from the student notebook.
"""
from __future__ import annotations

import ast
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # imported where used: nbformat's import costs seconds (jsonschema's format checkers),
    import nbformat  # and the grader's child process, which never reads a notebook, imports this module

__all__ = ["read_notebook", "exercise_cell_source", "make_student_notebook", "solution_blocks",
           "INSTRUCTOR_TAG", "parse"]

INSTRUCTOR_TAG = "instructor-only"
_BEGIN, _END = "### BEGIN SOLUTION", "### END SOLUTION"
_HIDDEN = re.compile(r"^[ \t]*### BEGIN HIDDEN TESTS.*?^[ \t]*### END HIDDEN TESTS[^\n]*\n?", re.S | re.M)


_AST_LOCK = threading.Lock()


def parse(source: str) -> ast.Module:
    """ast.parse, one thread at a time: CPython 3.11's parser is not thread-safe ("AST constructor recursion
    depth mismatch"), and the grader parses from worker threads."""
    with _AST_LOCK:
        return ast.parse(source)


def read_notebook(path: str | Path) -> nbformat.NotebookNode:
    try:
        import nbformat

        return nbformat.read(str(path), as_version=4)
    except FileNotFoundError:
        raise ValueError(f"notebook {path} does not exist") from None
    except Exception as exc:
        raise ValueError(f"{path} is not a readable Jupyter notebook ({type(exc).__name__}: {exc}); "
                         f"submit the .ipynb file saved from Jupyter") from None


def _defined_names(source: str) -> set[str]:
    try:
        tree = parse(source)
    except SyntaxError:
        # A cell with a syntax error still "defines" what it textually declares, so the grader can
        # report the syntax error for that exercise instead of "cell not found".
        return set(re.findall(r"^(?:def|class)\s+(\w+)", source, re.M))
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _code(cell) -> str:
    # IPython magics/shell lines cannot run outside a kernel; grading ignores them.
    return "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in cell.source.splitlines())


def exercise_cell_source(nb: nbformat.NotebookNode, name: str) -> str | None:
    """Source of the last code cell that defines `name` at top level (None when no cell does)."""
    found = None
    for cell in nb.cells:
        if cell.cell_type == "code" and name in _defined_names(_code(cell)):
            found = _code(cell)
    return found


def _enclosing_def(lines: list[str], i: int, indent: int) -> str | None:
    for ln in reversed(lines[:i]):
        m = re.match(r"^(\s*)(?:async\s+)?def\s+(\w+)", ln)
        if m and len(m.group(1)) < indent:
            return m.group(2)
    return None


def _stub_code(source: str) -> str:
    source = _HIDDEN.sub("", source)
    lines, out, i = source.split("\n"), [], 0
    while i < len(lines):
        ln = lines[i]
        if ln.strip().startswith(_BEGIN):
            indent = len(ln) - len(ln.lstrip())
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(_END):
                j += 1
            if j == len(lines):
                raise ValueError(f"'{_BEGIN}' without '{_END}' in:\n{source[:400]}")
            name = _enclosing_def(lines, i, indent) or "solution"
            pad = ln[:indent]
            out += [f"{pad}# YOUR CODE HERE", f'{pad}raise NotImplementedError("exercise {name}")']
            i = j + 1
            continue
        out.append(ln)
        i += 1
    return "\n".join(out)


def _stub_markdown(source: str) -> str:
    return re.sub(re.escape(_BEGIN) + r".*?" + re.escape(_END), "*Your answer here.*", source, flags=re.S)


def make_student_notebook(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The student version of a solution notebook: stubs, no hidden tests, no outputs."""
    import nbformat

    out = nbformat.v4.new_notebook()
    out.metadata = dict(nb.metadata)
    out.metadata.setdefault("llmso", {})
    out.metadata["llmso"] = {**out.metadata["llmso"], "kind": "student"}
    out.nbformat, out.nbformat_minor = nb.nbformat, nb.nbformat_minor
    for cell in nb.cells:
        if INSTRUCTOR_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        new = nbformat.from_dict(dict(cell))
        if new.cell_type == "code":
            new.source = _stub_code(new.source)
            new.outputs, new.execution_count = [], None
        elif new.cell_type == "markdown":
            new.source = _stub_markdown(new.source)
        new.metadata = {k: v for k, v in new.metadata.items() if k not in ("execution", "collapsed", "scrolled")}
        out.cells.append(new)
    return out


def solution_blocks(nb: nbformat.NotebookNode) -> list[str]:
    """Texts between solution markers (what a student bundle must never contain)."""
    blocks = []
    for cell in nb.cells:
        for m in re.finditer(re.escape(_BEGIN) + r"[^\n]*\n(.*?)" + r"^[ \t]*" + re.escape(_END), cell.source, re.S | re.M):
            if m.group(1).strip():
                blocks.append(m.group(1))
        for m in _HIDDEN.finditer(cell.source):
            blocks.append(m.group(0))
    return blocks
