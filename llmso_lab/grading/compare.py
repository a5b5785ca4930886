"""Plain data and comparators.

`to_plain` turns what a student's function returned into plain data (tensors, numbers, strings, lists,
dicts) or refuses it; the grader's child and `check()` both use it, so they agree. A comparator is
`(got, expected) -> None` when they agree, else a message a student can act on. Comparators run in the
grading process on plain data only, after `guard` has checked that the result is not absurdly large.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

Comparator = Callable[[Any, Any], "str | None"]
PLAIN = (int, float, bool, str, type(None))
MAX_DEPTH = 20


def to_plain(obj: Any, depth: int = 0) -> Any:
    """A student's result as plain data (numpy arrays and scalars become tensors and numbers).

    Raises TypeError for anything else (custom classes, objects overriding ==, generators, ...).
    """
    import numpy as np

    if depth > MAX_DEPTH:
        raise TypeError("the result is nested too deeply")
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().as_subclass(torch.Tensor).clone()
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            return to_plain(obj.tolist(), depth + 1)
        return torch.from_numpy(np.array(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if type(obj) in PLAIN:
        return obj
    if type(obj) in (list, tuple):
        return type(obj)(to_plain(x, depth + 1) for x in obj)
    if type(obj) is dict:
        for k in obj:
            if type(k) not in (str, int):
                raise TypeError(f"returned a dict with a key of type {type(k).__name__}; use str or int keys")
        return {k: to_plain(v, depth + 1) for k, v in obj.items()}
    raise TypeError(f"returned a {type(obj).__name__}; return tensors, numbers, strings, lists or dicts")


def check_plain(obj: Any, path: str = "result", depth: int = 0) -> None:
    """Raise TypeError unless obj is plain data (what may cross from a student's process)."""
    if depth > MAX_DEPTH:
        raise TypeError(f"{path} is nested too deeply")
    if type(obj) in PLAIN or type(obj) is torch.Tensor:
        return
    if type(obj) in (list, tuple):
        for i, x in enumerate(obj):
            check_plain(x, f"{path}[{i}]", depth + 1)
        return
    if type(obj) is dict:
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise TypeError(f"{path} has a key of type {type(k).__name__}; use str or int keys")
            check_plain(v, f"{path}[{k!r}]", depth + 1)
        return
    raise TypeError(f"{path} is a {type(obj).__name__}; return tensors, numbers, strings, lists or dicts")


def _size(obj: Any) -> int:
    """Elements in plain data: a tensor counts its numel (a stride-0 view counts what it pretends to hold)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if isinstance(obj, (list, tuple)):
        return 1 + sum(_size(x) for x in obj)
    if isinstance(obj, dict):
        return 1 + sum(_size(v) for v in obj.values())
    if isinstance(obj, str):
        return 1 + len(obj) // 64
    return 1


def guard(got: Any, expected: Any) -> str | None:
    """Refuse a result far larger than the expected one before any comparator converts it (e.g. `.tolist()`
    of a 10^9-element stride-0 view). Cheap: it stops counting as soon as the limit is passed."""
    limit = max(16 * _size(expected), 100_000)
    seen, stack = 0, [got]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            seen += x.numel()
        elif isinstance(x, (list, tuple)):
            seen += 1
            stack.extend(x)
        elif isinstance(x, dict):
            seen += 1
            stack.extend(x.values())
        else:
            seen += 1
        if seen > limit:
            shape = f" (a tensor of shape {list(x.shape)})" if isinstance(x, torch.Tensor) else ""
            return f"the result is far larger than expected{shape}: return only what the exercise asks for"
    return None


def _pair(g: float, e: float, gdt: str, edt: str) -> str:
    """'got X, expected Y' with enough digits that X and Y differ on the page, and dtypes when they matter."""
    for digits in (6, 9, 12, 17):
        gs, es = f"{g:.{digits}g}", f"{e:.{digits}g}"
        if gs != es:
            break
    dtypes = f" ({gdt} vs {edt})" if gdt != edt else ""
    return f"got {gs}, expected {es}{dtypes}"


def _dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "") if isinstance(x, torch.Tensor) else type(x).__name__


def _as_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if type(x) in (int, float, bool):
        return torch.tensor(float(x), dtype=torch.float64)
    return None


def _short(x: Any, n: int = 160) -> str:
    text = repr(x.tolist() if isinstance(x, torch.Tensor) and x.numel() <= 4096 else x)
    return text if len(text) <= n else text[:n - 3] + "..."


Leaf = Callable[[Any, Any, str], "str | None"]


def _walk(got: Any, exp: Any, path: str, leaf: Leaf, wrong_count: Callable[[Any, Any, str, str], str],
          dicts: bool) -> str | None:
    """The one recursion over nested results, shared by `close` and `exact`: the first mismatch, named by
    where it is (`result[2]['k']`).

    Lists and tuples are compared item by item, and dicts key by key when `dicts`; anything else is a leaf,
    judged by `leaf(got, exp, path)`. A sequence of the wrong kind or length is reported by
    `wrong_count(got, exp, path, what)` (`what` says what came instead), so each comparator keeps its own
    wording.
    """
    if isinstance(exp, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(exp):
            what = f"{len(got)} items" if isinstance(got, (list, tuple)) else f"a {type(got).__name__}"
            return wrong_count(got, exp, path, what)
        for i, (g, e) in enumerate(zip(got, exp)):
            if (msg := _walk(g, e, f"{path}[{i}]", leaf, wrong_count, dicts)) is not None:
                return msg
        return None
    if dicts and isinstance(exp, dict):
        if not isinstance(got, dict) or set(got) != set(exp):
            keys = sorted(got, key=str) if isinstance(got, dict) else f"a {type(got).__name__}"
            return f"{path}: expected keys {sorted(exp, key=str)}, got {keys}"
        for k in exp:
            if (msg := _walk(got[k], exp[k], f"{path}[{k!r}]", leaf, wrong_count, dicts)) is not None:
                return msg
        return None
    return leaf(got, exp, path)


def close(atol: float = 1e-5, rtol: float = 1e-5, check_dtype: bool = False) -> Comparator:
    """Numbers/tensors (possibly nested in tuples/lists) equal within atol + rtol * |expected|."""

    def leaf(got: Any, exp: Any, path: str) -> str | None:
        e, g = _as_tensor(exp), _as_tensor(got)
        if e is None:
            return None if got == exp else f"{path}: expected {_short(exp)}, got {_short(got)}"
        if g is None:
            return f"{path}: expected a number or tensor, got {type(got).__name__}"
        if isinstance(exp, torch.Tensor) and tuple(g.shape) != tuple(e.shape):
            return f"{path}: shape {list(g.shape)}, expected {list(e.shape)}"
        if check_dtype and isinstance(exp, torch.Tensor) and g.dtype != e.dtype:
            return f"{path}: dtype {g.dtype}, expected {e.dtype}"
        if g.is_complex() or e.is_complex():
            return f"{path}: complex values are not expected here"
        g64, e64 = g.to(torch.float64).reshape(e.shape), e.to(torch.float64)
        nan_ok = torch.isnan(g64) == torch.isnan(e64)
        if not bool(nan_ok.all()):
            return f"{path}: NaN where the reference has none (or the other way round)"
        g64, e64 = torch.nan_to_num(g64, nan=0.0), torch.nan_to_num(e64, nan=0.0)
        if e64.numel() == 0:
            return None
        inf_ok = torch.where(torch.isinf(e64), g64 == e64, torch.ones_like(g64, dtype=torch.bool))
        err = torch.where(torch.isinf(e64), torch.zeros_like(g64), (g64 - e64).abs())
        bad = (err > atol + rtol * e64.abs().nan_to_num(posinf=0.0)) | ~inf_ok
        if bool(bad.any()):
            idx = tuple(int(i) for i in torch.nonzero(bad)[0]) if e64.dim() else ()
            at = f" at index {list(idx)}" if idx else ""
            pair = _pair(g64[idx].item(), e64[idx].item(), _dtype_name(got), _dtype_name(exp))
            return (f"{path}: {pair}{at} (max abs error {err.max().item():.3g}, allowed atol={atol:g} "
                    f"rtol={rtol:g})")
        return None

    def wrong_count(got: Any, exp: Any, path: str, what: str) -> str:
        return f"{path}: expected a sequence of {len(exp)} items, got {what}"

    # A dict is one leaf here, compared with ==: a tolerance inside dicts would change what passes.
    return lambda got, exp: _walk(got, exp, "result", leaf, wrong_count, dicts=False)


def exact() -> Comparator:
    """Plain data equal exactly (tensors by value, shape and dtype; ints and floats by value)."""

    def leaf(got: Any, exp: Any, path: str) -> str | None:
        if isinstance(exp, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                return f"{path}: expected a tensor {_short(exp)}, got {type(got).__name__} {_short(got)}"
            if got.shape != exp.shape:
                return f"{path}: shape {list(got.shape)}, expected {list(exp.shape)}: expected {_short(exp)}, got {_short(got)}"
            if not torch.equal(got.cpu(), exp.cpu()):
                return f"{path}: expected {_short(exp)}, got {_short(got)}"
            if got.dtype != exp.dtype:  # torch.equal ignores dtype
                return f"{path}: dtype {got.dtype}, expected {exp.dtype}"
            return None
        if type(exp) is float and type(got) in (int, float) and math.isclose(got, exp, rel_tol=1e-12, abs_tol=1e-12):
            return None
        numbers = (int, float)
        if type(got) is not type(exp) and not (type(exp) in numbers and type(got) in numbers):
            return f"{path}: expected {type(exp).__name__} {_short(exp)}, got {type(got).__name__} {_short(got)}"
        return None if got == exp else f"{path}: expected {_short(exp)}, got {_short(got)}"

    def wrong_count(got: Any, exp: Any, path: str, what: str) -> str:
        return f"{path}: expected {len(exp)} items, got {what}: expected {_short(exp)}, got {_short(got)}"

    return lambda got, exp: _walk(got, exp, "result", leaf, wrong_count, dicts=True)


def same_distribution(alpha: float = 1e-3, min_expected: float = 5.0) -> Comparator:
    """Samples drawn from the expected distribution (sampling exercises): a chi-square goodness-of-fit test.

    `expected` is a probability vector [V]; `got` is a 1-D integer tensor (or list) of sampled indices. Bins
    whose expected count is below `min_expected` are pooled. A sample of an index with probability 0 fails at
    once. Fails when the p-value is below `alpha` (a correct sampler fails 1 time in 1/alpha; fix the seed).
    """

    def cmp(got: Any, exp: Any) -> str | None:
        p = torch.as_tensor(exp, dtype=torch.float64).flatten()
        try:
            x = torch.as_tensor(got).flatten()
        except (TypeError, ValueError, RuntimeError):
            return f"expected a 1-D tensor of sampled indices, got {type(got).__name__}"
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            return f"expected integer token indices, got dtype {x.dtype}"
        n = x.numel()
        if n == 0:
            return "no samples were returned"
        if bool(((x < 0) | (x >= p.numel())).any()):
            return f"sampled an index outside [0, {p.numel()})"
        counts = torch.bincount(x.long(), minlength=p.numel()).to(torch.float64)
        impossible = (p == 0) & (counts > 0)
        if bool(impossible.any()):
            i = int(torch.nonzero(impossible)[0])
            return f"sampled index {i}, which has probability 0"
        want = p / p.sum() * n
        keep = want >= min_expected
        obs = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
        wnt = torch.cat([want[keep], want[~keep].sum().reshape(1)])
        obs, wnt = obs[wnt > 0], wnt[wnt > 0]
        dof = obs.numel() - 1
        if dof < 1:
            return None
        stat = float(((obs - wnt) ** 2 / wnt).sum())
        pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                               torch.tensor(stat / 2, dtype=torch.float64)))
        if pvalue < alpha:
            worst = int(torch.argmax((counts - want).abs()))
            return (f"the samples do not follow the expected distribution (chi-square {stat:.1f} with {dof} "
                    f"degrees of freedom, p = {pvalue:.2g} < {alpha:g}); e.g. index {worst}: {int(counts[worst])} "
                    f"draws, expected about {want[worst]:.0f}")
        return None

    return cmp
