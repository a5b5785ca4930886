"""An optional native kernel for decode steps: a GEMV in C++ that reads each weight once (`native_gemv.cpp`).

Why (Lab 00 §6, `llmso-lab bench llamacpp`): at batch 1 the weight matmuls of a decode step are matrix-vector products,
and how fast they stream the weights from memory decides the step. Over SmolLM2's 121 matrices with one row of x on
the reference CPU, oneDNN's prepacked kernel read them at ~22 GB/s, plain `x @ W` slower, llama.cpp's kernels at
~33 GB/s; this kernel (4 weight rows at a time, every x row multiplied while they sit in L1, AVX-512 FMA / AVX512-BF16
dot products, ATen's threads) at ~25-28 GB/s: 19.5 ms instead of 24.4 (fp32) and 10.8 instead of 13.3 (bf16).
With more rows oneDNN's blocked kernels win (bf16 from 4 rows), so `NativeGemvLinear` sends only up to `MAX_ROWS`
rows here and the rest to the kernel the engine would use anyway (it keeps both copies of each weight).

Opt-in: `LLMSO_LAB_NATIVE_GEMV=1` when the engine is built (`engine.features.matmul_kernel`), because the kernel is
compiled with the C++ compiler on first use (`torch.utils.cpp_extension`, ~25 s, then cached in
`~/.cache/torch_extensions`), which a student's laptop may not have and a graded run must not wait for. Where it
cannot be built (no AVX-512, no compiler or ninja, not x86-64) `load()` says why and the engine keeps its kernels.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from llmso_lab.engine.ops import linear

__all__ = ["load", "NativeGemvLinear", "requested", "enabled", "MAX_ROWS", "ENV"]

SOURCE = Path(__file__).with_name("native_gemv.cpp")
ENV = "LLMSO_LAB_NATIVE_GEMV"
MAX_ROWS = {torch.float32: 8, torch.bfloat16: 2}   # rows up to which the GEMV beat oneDNN here (fp32 ties at 16)
K_MULTIPLE = {torch.float32: 16, torch.bfloat16: 32}


def requested() -> bool:
    return os.environ.get(ENV, "") == "1"


@contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """Engines built inside the block use the native GEMV (`on=True`) or not, whatever the environment says."""
    old = os.environ.get(ENV)
    os.environ[ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


@functools.lru_cache(maxsize=None)
def load():
    """(the compiled module, "why") or (None, why it is not available). Compiles once per machine and source."""
    from llmso_lab import hardware as hw

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the native GEMV is x86-64 only (this is {platform.machine()})"
    flags = hw.cpu_flags()
    if "avx512f" not in flags:
        return None, "the native GEMV needs AVX-512 (this CPU has none): the engine keeps torch's kernels"
    key = hashlib.sha1((SOURCE.read_text() + torch.__version__ + " ".join(sorted(flags))).encode()).hexdigest()[:12]
    try:
        from torch.utils.cpp_extension import load as build
        mod = build(f"llmso_lab_gemv_{key}", [str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:   # no compiler, no ninja, a read-only cache: say so and keep torch's kernels
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, (f"the native GEMV could not be built ({type(exc).__name__}: {first[:200]}); it needs a C++ "
                      "compiler and ninja (`pip install ninja`)")
    bf16 = " and bf16 (AVX512-BF16)" if mod.has_bf16() else " (bf16: this CPU has no AVX512-BF16)"
    return mod, f"native GEMV built for fp32{bf16}"


def supports(w_t: Tensor) -> bool:
    """Can the kernel multiply by this engine weight ([in, out])? fp32 / bf16 (bf16 only where it was built with
    AVX512-BF16) with `in` a multiple of 16 / 32."""
    mod, _ = load()
    if mod is None or w_t.dtype not in MAX_ROWS or w_t.device.type != "cpu":
        return False
    if w_t.dtype == torch.bfloat16 and not mod.has_bf16():
        return False
    return w_t.shape[0] % K_MULTIPLE[w_t.dtype] == 0


class NativeGemvLinear:
    """x [T, in] -> [T, out]: up to `MAX_ROWS` rows through the native GEMV (weight [out, in], read once), more rows
    through `big` (the engine's usual kernel: a prepacked `OneDNNLinear` or the plain [in, out] weight)."""

    def __init__(self, w_t: Tensor, big=None) -> None:
        self.mod, _ = load()
        assert self.mod is not None and supports(w_t), "check native.supports(w) first"
        self.w = w_t.t().contiguous()                 # [out, in]
        self.big = w_t if big is None else big
        self.shape, self.dtype = tuple(w_t.shape), w_t.dtype
        self.max_rows = MAX_ROWS[w_t.dtype]

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[0] <= self.max_rows and x.dtype == self.dtype:
            return self.mod.gemv(x.contiguous(), self.w)
        return linear(x, self.big)

    @property
    def in_features(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes one decode step reads (the [out, in] copy; the copy for many rows is not read then)."""
        return self.w.numel() * self.w.element_size()
