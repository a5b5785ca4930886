"""Disable the library references of the exercise being graded, so that calling them earns nothing.

Two mechanisms, one message:
- in the grader's sandbox the student's process imports a copy of the library whose disabled functions
  were rewritten at the source (`stub_package`): reloading the module, exec-ing its source, starting a fresh
  interpreter or a spawned process all find the stub, because the original text is not there;
- `check()` runs in the student's own kernel, so it swaps code objects in place (`tripwire`) and restores
  them afterwards: every alias of a Python function trips (a name imported earlier, a method, a function
  stored in a dict, a closure). Builtins (torch's SDPA, Tensor methods) are replaced by name in their owner;
  the grader's child does this too (`disable`), for what has no source to rewrite.
A third mechanism covers computations torch reaches by many routes: a Python name swapped in its owner does not
stop `torch._C._nn.scaled_dot_product_attention` or `torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`.
For the references in `OPERATORS`, `DispatcherTripwire` registers a raising kernel for every matching aten
operator in torch's dispatcher, which every route ends in; `intact()` says whether the registrations are still
the ones it made (a submission that removes or replaces them loses the case: see `child.py` and `check.py`).
A student can still copy library source by hand; the grader reports near-copies to the instructor.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from llmso_lab.grading.notebook import parse
from llmso_lab.grading.registry import resolve

MARK = "TRIPWIRE"
PACKAGE_DIR = Path(__file__).resolve().parents[1]   # the llmso_lab package the references come from


def message(ref: str, exercise: str) -> str:
    return (f"{MARK}: your code called {ref.replace(':', '.')}, which is disabled while exercise '{exercise}' is "
            "graded (it would do the exercise for you); write your own implementation.")


def _unwrap(obj: Any) -> Any:
    while hasattr(obj, "__wrapped__") and not inspect.isclass(obj):
        obj = obj.__wrapped__
    return obj


def _kernel_fn(obj: Any) -> Any:
    """The Python function behind a `@triton.jit` kernel (JITFunction, or InterpretedFunction under the
    interpreter), else None."""
    fn = getattr(obj, "fn", None)
    return fn if inspect.isfunction(fn) and type(obj).__module__.startswith("triton") else None


def _functions(obj: Any) -> list:
    if isinstance(obj, property):
        obj = obj.fget
    if (kernel := _kernel_fn(obj)) is not None:
        return [kernel]   # stubbed at the source (the grader's child) or by its code (check(), the interpreter)
    obj = _unwrap(obj)
    if inspect.isfunction(obj):
        return [obj]
    if inspect.isclass(obj):
        fns = []
        for v in vars(obj).values():
            v = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
            v = v.fget if isinstance(v, property) else v
            if inspect.isfunction(_unwrap(v)):
                fns.append(_unwrap(v))
        return fns
    return []


def _trip_code(text: str, freevars: tuple[str, ...]):
    """A code object that raises RuntimeError(text) and has exactly these free variables (so it can replace
    the code of a closure: a function's code and its closure cells must agree)."""
    if not freevars:
        src = f"def _tripwire(*args, **kwargs):\n    raise RuntimeError({text!r})\n"
        ns: dict = {}
        exec(compile(src, "<tripwire>", "exec"), ns)
        return ns["_tripwire"].__code__
    names = ", ".join(freevars)
    src = (f"def _outer():\n    {names} = {', '.join(['None'] * len(freevars))}\n"
           f"    def _tripwire(*args, **kwargs):\n        ({names},)\n        raise RuntimeError({text!r})\n"
           f"    return _tripwire\n")
    ns = {}
    exec(compile(src, "<tripwire>", "exec"), ns)
    code = ns["_outer"]().__code__
    return code if code.co_freevars == freevars else None


def _owner(ref: str) -> tuple[Any, str]:
    mod, _, attr = ref.partition(":")
    parent, _, last = attr.rpartition(".")
    return (resolve(f"{mod}:{parent}") if parent else importlib.import_module(mod)), last


def kernels_behind(references: Sequence[str], depth: int = 3) -> list[str]:
    """The `@triton.jit` kernels of this package that the functions in `references` launch, directly or through the
    package's functions they call (up to `depth` calls down): disabled with them, so that a submission cannot launch
    the kernel itself instead of its disabled wrapper."""
    found, seen = [], set()

    def walk(fn: Any, left: int) -> None:
        if id(fn) in seen or left < 0 or not _in_package(fn):
            return
        seen.add(id(fn))
        names, codes = set(), [fn.__code__]
        while codes:
            code = codes.pop()
            names |= set(code.co_names)
            codes += [c for c in code.co_consts if inspect.iscode(c)]
        objs = [fn.__globals__.get(n) for n in names]
        objs += [getattr(m, n, None) for m in objs if inspect.ismodule(m) for n in names]
        for obj in objs:
            if (kernel := _kernel_fn(obj)) is not None and _in_package(kernel):
                ref = f"{kernel.__module__}:{kernel.__name__}"
                if ref not in found:
                    found.append(ref)
            elif inspect.isfunction(obj):
                walk(obj, left - 1)

    for ref in references:
        try:
            fns = _functions(resolve(ref))
        except (ImportError, AttributeError):
            continue
        for fn in fns:
            walk(fn, depth)
    return [k for k in found if k not in references]


def why_not_disableable(ref: str) -> str | None:
    """None when `ref` can be disabled by both mechanisms, else the reason."""
    try:
        obj = resolve(ref)
    except (ImportError, AttributeError) as exc:
        return f"it does not resolve ({type(exc).__name__}: {exc})"
    fns = _functions(obj)
    if inspect.isclass(_unwrap(obj)) and not fns:
        return "a class without methods"
    for fn in fns:
        if _trip_code("x", fn.__code__.co_freevars) is None:
            return f"{fn.__qualname__} has free variables a tripwire cannot take"
        if _in_package(fn) and _locate_def(fn) is None:
            return f"cannot find the source of {fn.__qualname__} to stub it"
    if not fns:
        try:
            owner, last = _owner(ref)
            setattr(owner, last, getattr(owner, last))
        except (AttributeError, TypeError, ImportError) as exc:
            return f"it cannot be replaced by name ({exc})"
    return None


# ---- runtime: check() and, for builtins, the grader's child ----------------------------------
def _swap(refs: Sequence[str], exercise: str) -> list:
    saved = []
    for ref in refs:
        obj = resolve(ref)
        fns = _functions(obj)
        for fn in fns:
            code = _trip_code(message(ref, exercise), fn.__code__.co_freevars)
            saved.append((fn, "__code__", fn.__code__))
            fn.__code__ = code
        if hasattr(obj, "cache_clear"):  # a functools cache would answer without calling the code
            obj.cache_clear()
        if not fns:  # a builtin or C function: replace it by name in its owner
            owner, last = _owner(ref)
            saved.append((owner, last, getattr(owner, last)))
            ns: dict = {}
            exec(compile(f"def _tripwire(*args, **kwargs):\n    raise RuntimeError({message(ref, exercise)!r})\n",
                         "<tripwire>", "exec"), ns)
            setattr(owner, last, ns["_tripwire"])
    return saved


@contextmanager
def tripwire(references: str | Sequence[str], exercise: str) -> Iterator[None]:
    """While active, any call into `references` ("module:attr") raises RuntimeError('TRIPWIRE: ...')."""
    saved = _swap([references] if isinstance(references, str) else list(references), exercise)
    try:
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


class Armed:
    """`tripwire(references)`, armed while any student call runs (ranks run several at once) and disarmed between
    them: a mechanism exercise's harness runs the library around the student's code in the same process (check(),
    the delegation scan), and the engine keeps its own functions; only what the student's code calls trips."""

    def __init__(self, references: Sequence[str], exercise: str) -> None:
        self.references, self.exercise = tuple(references), exercise
        self.lock, self.count, self.context = threading.Lock(), 0, None

    def __enter__(self) -> None:
        with self.lock:
            if self.count == 0:
                self.context = tripwire(self.references, self.exercise)
                self.context.__enter__()
            self.count += 1

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.count -= 1
            if self.count == 0:
                self.context.__exit__(None, None, None)
                self.context = None


def disable(references: Sequence[str], exercise: str) -> None:
    """Disable for good (the grader's child); keeps no reference to the originals. References whose module
    is not importable here (nothing outside the student bundle is) cannot be called anyway."""
    for ref in references:
        try:
            resolve(ref)
        except ImportError:
            continue
        _swap([ref], exercise)


# ---- source: the student bundle the grader's child imports -------------------------------------
def _in_package(fn: Any) -> bool:
    try:
        return Path(inspect.getsourcefile(fn) or "").resolve().is_relative_to(PACKAGE_DIR)
    except TypeError:
        return False


def _locate_def(fn: Any) -> tuple[Path, str] | None:
    """(file relative to the package, qualname) of a function defined at module or class level."""
    path = Path(inspect.getsourcefile(fn)).resolve()
    parts = fn.__qualname__.split(".")
    if "<locals>" in parts:
        return None
    return (path.relative_to(PACKAGE_DIR), fn.__qualname__) if _find(parse(path.read_text()), parts) else None


def _find(tree: ast.AST, parts: list[str]) -> ast.AST | None:
    node = tree
    for part in parts:
        node = next((n for n in getattr(node, "body", []) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                             ast.ClassDef)) and n.name == part), None)
        if node is None:
            return None
    return node


def _stub_source(source: str, targets: list[tuple[str, str]]) -> str:
    """Replace the body of each (qualname, message) def with `raise RuntimeError(message)`."""
    tree, lines = parse(source), source.splitlines(keepends=True)
    edits = []
    for qualname, text in targets:
        node = _find(tree, qualname.split("."))
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), qualname
        first = node.body[0]
        edits.append((first.lineno, first.col_offset, node.end_lineno, f"raise RuntimeError({text!r})"))
    for start, col, end, stmt in sorted(edits, reverse=True):
        head = lines[start - 1].encode()[:col].decode()   # col_offset counts UTF-8 bytes
        lines[start - 1:end] = [head + stmt + "\n"]        # keeps `def f(): ` on a one-line def
    out = "".join(lines)
    compile(out, "<stubbed>", "exec")   # a stub must never break the module
    return out


def stub_package(package_copy: Path, references: Sequence[str], exercise: str) -> list[str]:
    """Rewrite, in a copy of the llmso_lab package, every disabled function (every method of a disabled
    class) to raise the tripwire message. Returns the references with no source here (for `disable`)."""
    by_file: dict[Path, list[tuple[str, str]]] = {}
    remaining = []
    for ref in references:
        fns = [fn for fn in _functions(resolve(ref)) if _in_package(fn)]
        if not fns:
            remaining.append(ref)
            continue
        for fn in fns:
            rel, qualname = _locate_def(fn)
            by_file.setdefault(rel, []).append((qualname, message(ref, exercise)))
    for rel, targets in by_file.items():
        path = Path(package_copy) / rel
        if path.exists():   # absent (the spec modules): nothing in the job can import it
            path.write_text(_stub_source(path.read_text(), targets))
    return remaining


# ---- the dispatcher: operators torch reaches by many names ---------------------------------------
# A disabled reference -> substrings of the aten operator names that compute the same thing (every overload,
# the backends' fused kernels and the math fallback).
OPERATORS = {
    "torch.nn.functional:scaled_dot_product_attention": ("scaled_dot_product", "_native_multi_head_attention"),
}
_KEYS = ("CompositeImplicitAutograd", "CompositeExplicitAutograd", "CPU", "CUDA")


def operator_tripwires(references: Sequence[str]) -> list[str]:
    """Those of `references` that are also disabled at the dispatcher."""
    return [r for r in references if r in OPERATORS]


def _operator_names(references: Sequence[str]) -> list[str]:
    import torch

    subs = [sub for r in references for sub in OPERATORS.get(r, ())]
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::") and
                  any(sub in n for sub in subs))


class DispatcherTripwire:
    """Raising kernels for the aten operators behind `references` (see `OPERATORS`), for as long as it lives."""

    def __init__(self, references: Sequence[str], exercise: str) -> None:
        self.references = operator_tripwires(references)
        self.exercise = exercise
        self._lib = None
        self._dumps: dict[str, str] = {}

    def install(self) -> "DispatcherTripwire":
        import torch

        if not self.references:
            return self
        text = message(" / ".join(self.references) + " (by any name: torch._C, torch.ops.aten)", self.exercise)

        def _operator_tripwire(*args, **kwargs):
            raise RuntimeError(text)

        self._lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():   # "overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore")
            for full in _operator_names(self.references):
                name = full.split("::", 1)[1]
                for key in _KEYS:
                    if torch._C._dispatch_has_kernel_for_dispatch_key(full, key):
                        self._lib.impl(name, _operator_tripwire, key)
                self._dumps[full] = torch._C._dispatch_dump(full)
        return self

    def intact(self) -> bool:
        """Are the registrations still exactly those `install` made (none removed, none replaced)?"""
        import torch

        return all(torch._C._dispatch_dump(full) == dump for full, dump in self._dumps.items())

    def broken_message(self) -> str:
        return (f"{MARK}: the dispatcher tripwire on {', '.join(self.references)} was removed or replaced while "
                f"exercise '{self.exercise}' was graded; this check and the ones after it are not counted.")

    def remove(self) -> None:
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None

    def __enter__(self) -> "DispatcherTripwire":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()
