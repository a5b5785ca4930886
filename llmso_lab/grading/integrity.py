"""Near-copies of the library reference, reported to the instructor (never to the student, never failing).

A student can always copy library source by hand. The grader cannot stop that, but it can notice it: the
submitted function and the reference are compared after normalisation (docstrings and annotations dropped,
local names renamed in order of first use), so renaming variables does not hide a copy. Short references are
skipped: a one-line formula written independently looks the same as the library's.
"""
from __future__ import annotations

import ast
import difflib
import inspect
import textwrap

from llmso_lab.grading.notebook import parse
from llmso_lab.grading.registry import Exercise, resolve

MIN_NODES = 40        # references smaller than this are formulas anyone would write alike
THRESHOLD = 0.9       # similarity of the normalised token streams that counts as a near-copy


class _Normalize(ast.NodeTransformer):
    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def _rename(self, name: str) -> str:
        return self.names.setdefault(name, f"v{len(self.names)}")

    def visit_FunctionDef(self, node):
        node.name = "f"
        node.returns = None
        node.decorator_list = []
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
        self.generic_visit(node)
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_arg(self, node):
        node.arg, node.annotation = self._rename(node.arg), None
        return node

    def visit_Name(self, node):
        node.id = self._rename(node.id)
        return node

    def visit_Constant(self, node):
        if isinstance(node.value, str):   # comments are gone already; strings are messages, not logic
            node.value = ""
        return node


def _tokens(node: ast.AST) -> list[str]:
    node = _Normalize().visit(node)
    return ast.dump(node, annotate_fields=False, include_attributes=False).replace("(", " ( ").replace(
        ")", " ) ").replace(",", " ").split()


def _definition(source: str, name: str) -> ast.AST | None:
    try:
        tree = parse(source)
    except SyntaxError:
        return None
    return next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name == name), None)


def near_copy(ex: Exercise, cell_source: str) -> str | None:
    """A note for the instructor when the graded definition is the library reference with names changed."""
    try:
        ref = resolve(ex.reference)
        ref_src = textwrap.dedent(inspect.getsource(ref))
    except (TypeError, OSError, ImportError, AttributeError):
        return None
    ref_node = _definition(ref_src, getattr(ref, "__name__", ""))
    mine = _definition(cell_source, ex.graded_name)
    if ref_node is None or mine is None or sum(1 for _ in ast.walk(ref_node)) < MIN_NODES:
        return None
    a, b = _tokens(mine), _tokens(ref_node)
    ratio = difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()
    if ratio < THRESHOLD:
        return None
    return (f"{ex.key}: the submitted `{ex.graded_name}` matches the library's {ex.reference.replace(':', '.')} "
            f"after renaming (similarity {ratio:.2f}); it may have been copied. Not penalised; please review.")
