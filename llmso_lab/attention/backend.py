"""Which attention backend can run here: Triton kernels (GPU, or CPU under the interpreter) or torch.

This module never imports triton itself, so it is safe to import on any platform.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import warnings

import torch

__all__ = ["triton_available", "interpreter_enabled", "check_kernel_inputs", "warn_fallback"]

INTERPRET_HINT = "set TRITON_INTERPRET=1 before importing triton to run kernels on CPU"


@functools.cache
def triton_available() -> bool:
    """True when the Triton kernels can be imported: Linux with the `triton` package installed."""
    return sys.platform.startswith("linux") and importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET=1 is set (Triton then runs kernels on the CPU, in numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_kernel_inputs(kernel: object, *tensors: torch.Tensor) -> None:
    """Raise a clear error when a Triton kernel cannot run on these tensors.

    `kernel` is the `@triton.jit` object. Triton decides at *decoration* time (when the kernel module
    is imported) whether a kernel is compiled for a GPU or interpreted, so we look at the kernel object,
    not at the environment variable now.
    """
    devices = {t.device.type for t in tensors}
    assert len(devices) == 1, f"all tensors must be on one device, got {sorted(devices)}"
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    if "cpu" in devices and not interpreted:
        raise RuntimeError(
            f"Triton kernel called on CPU tensors: {INTERPRET_HINT} "
            "(or use the torch references in llmso_lab.attention.reference)"
        )
    if interpreted and any(t.dtype == torch.bfloat16 for t in tensors):
        raise RuntimeError("the Triton interpreter computes bf16 tl.dot wrongly: use fp32 or fp16 on CPU "
                           "(bf16 works on a GPU)")


_warned = False


def warn_fallback(name: str) -> None:
    """Say once per process that torch references replace the Triton kernels (`name`: the first caller)."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"llmso_lab.attention.{name}: Triton is not available on this platform; "
                      "the attention kernels use the torch references instead", RuntimeWarning, stacklevel=3)
