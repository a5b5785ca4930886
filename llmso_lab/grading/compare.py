"""Comparators: `(got, expected) -> None` when they agree, else a message a student can act on.

They run in the grading process on plain data only (tensors, numbers, strings, lists, dicts).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

Comparator = Callable[[Any, Any], "str | None"]
PLAIN = (int, float, bool, str, type(None))


def check_plain(obj: Any, path: str = "result", depth: int = 0) -> None:
    """Raise TypeError unless obj is plain data (what may cross from a student's process)."""
    if depth > 20:
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


def _as_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if type(x) in (int, float, bool):
        return torch.tensor(float(x), dtype=torch.float64)
    return None


def close(atol: float = 1e-5, rtol: float = 1e-5, check_dtype: bool = False) -> Comparator:
    """Numbers/tensors (possibly nested in tuples/lists) equal within atol + rtol * |expected|."""

    def cmp(got: Any, exp: Any, path: str = "result") -> str | None:
        if isinstance(exp, (tuple, list)):
            if not isinstance(got, (tuple, list)) or len(got) != len(exp):
                n = len(got) if isinstance(got, (tuple, list)) else type(got).__name__
                return f"{path}: expected a sequence of {len(exp)} items, got {n}"
            for i, (g, e) in enumerate(zip(got, exp)):
                if (msg := cmp(g, e, f"{path}[{i}]")) is not None:
                    return msg
            return None
        e, g = _as_tensor(exp), _as_tensor(got)
        if e is None:
            return None if got == exp else f"{path}: expected {exp!r}, got {got!r}"
        if g is None:
            return f"{path}: expected a number or tensor, got {type(got).__name__}"
        if isinstance(exp, torch.Tensor) and tuple(g.shape) != tuple(e.shape):
            return f"{path}: shape {list(g.shape)}, expected {list(e.shape)}"
        if check_dtype and isinstance(exp, torch.Tensor) and g.dtype != e.dtype:
            return f"{path}: dtype {g.dtype}, expected {e.dtype}"
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
            return (f"{path}: got {g64[idx].item():.6g}, expected {e64[idx].item():.6g}{at} "
                    f"(max abs error {err.max().item():.3g}, allowed atol={atol:g} rtol={rtol:g})")
        return None

    return lambda got, exp: cmp(got, exp)


def exact() -> Comparator:
    """Plain data equal exactly (tensors by value and shape)."""

    def cmp(got: Any, exp: Any, path: str = "result") -> str | None:
        if isinstance(exp, torch.Tensor):
            if not isinstance(got, torch.Tensor) or got.shape != exp.shape or not torch.equal(got.cpu(), exp.cpu()):
                return f"{path}: expected {exp.tolist()}, got {got.tolist() if isinstance(got, torch.Tensor) else got!r}"[:300]
            if got.dtype != exp.dtype:  # torch.equal ignores dtype
                return f"{path}: dtype {got.dtype}, expected {exp.dtype}"
            return None
        if isinstance(exp, (list, tuple)):
            if not isinstance(got, (list, tuple)) or len(got) != len(exp):
                return f"{path}: expected {len(exp)} items, got {got!r}"[:300]
            for i, (g, e) in enumerate(zip(got, exp)):
                if (msg := cmp(g, e, f"{path}[{i}]")) is not None:
                    return msg
            return None
        if isinstance(exp, dict):
            if not isinstance(got, dict) or set(got) != set(exp):
                return f"{path}: expected keys {sorted(exp)}, got {sorted(got) if isinstance(got, dict) else got!r}"
            for k in exp:
                if (msg := cmp(got[k], exp[k], f"{path}[{k!r}]")) is not None:
                    return msg
            return None
        if type(exp) is float and type(got) in (int, float) and math.isclose(got, exp, rel_tol=1e-12, abs_tol=1e-12):
            return None
        if type(got) is not type(exp) and not (type(exp) in (int, float) and type(got) in (int, float)):
            return f"{path}: expected {type(exp).__name__} {exp!r}, got {type(got).__name__} {got!r}"[:300]
        return None if got == exp else f"{path}: expected {exp!r}, got {got!r}"[:300]

    return lambda got, exp: cmp(got, exp)
