"""Accelerator table, this machine's measured ceilings, and roofline helpers used across the labs.

Units: FLOP/s, bytes/s, bytes, seconds. Peak numbers are vendor datasheet figures for *dense* BF16
tensor-core math (no 2:4 sparsity), the number a serving engineer should plan with.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "Accelerator", "ACCELERATORS", "get_accelerator", "set_lab_threads", "measure_cpu",
    "matmul_flops", "matmul_arithmetic_intensity", "ridge_point", "attainable_flops", "compute_bound_tokens",
    "roofline_time", "kv_bytes_per_token", "decode_bytes_per_step", "decode_tokens_per_s_bound",
]


@dataclass(frozen=True, slots=True)
class Accelerator:
    name: str
    peak_flops: float        # dense bf16 FLOP/s (fp32 for a CPU)
    mem_bandwidth: float     # HBM (or DRAM) bytes/s
    mem_bytes: float         # device memory in bytes
    interconnect: str        # GPU<->GPU link
    interconnect_bw: float   # bytes/s per direction per GPU
    host_bw: float           # PCIe bytes/s per direction (KV swap to CPU memory)
    num_sms: int = 0         # streaming multiprocessors (0 for a CPU)

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the roofline turns from memory- to compute-bound."""
        return ridge_point(self.peak_flops, self.mem_bandwidth)


T, G = 1e12, 1e9
ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS BF16 dense (1,979 with sparsity),
    # 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s total (450 GB/s per direction), PCIe Gen5 x16 64 GB/s.
    "H100-SXM": Accelerator("H100-SXM", 989 * T, 3.35e12, 80 * G, "NVLink4", 450 * G, 64 * G, 132),
    # NVIDIA H200 datasheet (SXM): 989 TFLOPS BF16 dense, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s.
    "H200": Accelerator("H200", 989 * T, 4.8e12, 141 * G, "NVLink4", 450 * G, 64 * G, 132),
    # NVIDIA A100 datasheet (80GB SXM): 312 TFLOPS BF16 dense, 2,039 GB/s HBM2e, NVLink 600 GB/s,
    # PCIe Gen4 x16 32 GB/s.
    "A100-80GB": Accelerator("A100-80GB", 312 * T, 2.039e12, 80 * G, "NVLink3", 300 * G, 32 * G, 108),
    # NVIDIA L4 datasheet: 121 TFLOPS BF16 dense (242 with sparsity), 300 GB/s GDDR6, 24 GB,
    # no NVLink (PCIe Gen4 x16, 32 GB/s per direction).
    "L4": Accelerator("L4", 121 * T, 300 * G, 24 * G, "PCIe4", 32 * G, 32 * G, 58),
    # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): 82.6 TFLOPS BF16 dense with FP32
    # accumulate, 1,008 GB/s GDDR6X, 24 GB, no NVLink (PCIe Gen4 x16).
    "RTX4090": Accelerator("RTX4090", 82.6 * T, 1008 * G, 24 * G, "PCIe4", 32 * G, 32 * G, 128),
}


def get_accelerator(name: str) -> Accelerator:
    """Look up an accelerator by name (case-insensitive)."""
    for key, acc in ACCELERATORS.items():
        if key.lower() == name.lower():
            return acc
    raise ValueError(f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}")


def set_lab_threads(num_threads: int | None = None) -> int:
    """The one thread policy of the labs and the demo; returns the thread count torch now uses.

    `num_threads`, else $LLMSO_LAB_THREADS, else every core this process may run on. A CPU's ceilings and
    every model timing hold only for the thread count they were measured with, so each lab's setup cell calls
    this first and "this CPU" means the same thing in every lab.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = num_threads or int(os.environ.get("LLMSO_LAB_THREADS") or 0) or cores
    torch.set_num_threads(n)
    return n


def measure_cpu(seconds: float = 2.0, matmul_sizes: Sequence[int] = (256, 512, 1024), copy_mb: int = 256) -> Accelerator:
    """Measure this machine's fp32 matmul FLOP/s and memory copy bandwidth (read + write bytes).

    Both are ceilings, so both are the best single run, not an average (a run that another process
    interrupted says nothing about the hardware): FLOP/s over square matmuls of each size in
    `matmul_sizes` (the best size wins; outputs preallocated, so no page faults are timed), bandwidth
    over copies of `copy_mb` MiB. Takes about `seconds`, at the thread count torch uses now
    (see `set_lab_threads`); the name says that count.
    """
    peak, budget = 0.0, seconds / 2 / len(matmul_sizes)
    for size in matmul_sizes:
        a, b, c = torch.randn(size, size), torch.randn(size, size), torch.empty(size, size)
        torch.mm(a, b, out=c)  # warm up
        n, best, t_end = 0, float("inf"), time.perf_counter() + budget
        while time.perf_counter() < t_end or n < 3:
            t0 = time.perf_counter()
            torch.mm(a, b, out=c)
            best = min(best, time.perf_counter() - t0)
            n += 1
        peak = max(peak, matmul_flops(size, size, size) / best)

    src = torch.ones(copy_mb * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up: first touch of the pages
    n, best, t_end = 0, float("inf"), time.perf_counter() + seconds / 2
    while time.perf_counter() < t_end or n < 3:
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
        n += 1
    bw = 2 * src.numel() * 4 / best  # a copy reads and writes every byte
    threads = torch.get_num_threads()
    return Accelerator(f"this-cpu ({threads} thread{'s' if threads > 1 else ''})", peak, bw, 0.0, "none", 0.0, 0.0, 0)


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of [m, k] @ [k, n]: one multiply and one add per (i, j, l)."""
    return 2 * m * n * k


def matmul_arithmetic_intensity(m: int, n: int, k: int, bytes_per_elem: float = 2) -> float:
    """FLOP per byte of [m, k] @ [k, n] when A and B are read once and C written once."""
    return matmul_flops(m, n, k) / ((m * k + k * n + m * n) * bytes_per_elem)


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """Intensity (FLOP/byte) at which compute time equals memory time."""
    return peak_flops / bandwidth


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """Roofline: min(peak, intensity * bandwidth)."""
    return min(peak_flops, intensity * bandwidth)


def compute_bound_tokens(weight_bytes: float, flops_per_token: float, peak_flops: float, bandwidth: float) -> float:
    """New tokens per forward at which doing their math takes as long as reading the weights once.

    Below it a forward is memory-bound and costs about the same whatever the token count (a decode step, or
    speculative decoding's verification of a few draft tokens); above it the time grows with the tokens
    (prefill). It is the ridge point in tokens: FLOP/byte of one token per weight byte scaled to the ridge.
    """
    return ridge_point(peak_flops, bandwidth) * weight_bytes / flops_per_token


def roofline_time(flops: float, bytes_moved: float, peak_flops: float, bandwidth: float) -> float:
    """Lower bound on run time: the slower of doing the math and moving the bytes."""
    return max(flops / peak_flops, bytes_moved / bandwidth)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_elem: float = 2) -> int:
    """KV-cache bytes one token adds: K and V, in every layer, for every KV head."""
    return int(2 * num_layers * num_kv_heads * head_dim * bytes_per_elem)


def decode_bytes_per_step(weight_bytes: float, context_lens: Sequence[int], kv_bytes_per_token: float) -> float:
    """Bytes one decode step reads: all weights once (shared by the batch) + each sequence's KV cache."""
    return weight_bytes + sum(context_lens) * kv_bytes_per_token


def decode_tokens_per_s_bound(weight_bytes: float, bandwidth: float, batch: int = 1, context_len: int = 0,
                              kv_bytes_per_token: float = 0) -> float:
    """Memory-bound upper limit on generated tokens/s for `batch` sequences of `context_len` tokens."""
    step_bytes = decode_bytes_per_step(weight_bytes, [context_len] * batch, kv_bytes_per_token)
    return batch * bandwidth / step_bytes
