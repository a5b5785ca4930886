"""Benchmark for lecture 1-2: attention memory (everywhere) and kernel speed (CUDA only).

`run(quick)` returns {"name", "table", "ratios", "device", "date", "command", ...}; the CLI prints
`table` and writes the whole dict as JSON. Ratios are always measured in the same run.

- memory (CPU): peak bytes allocated by naive vs FlashAttention-style (tiled) torch attention for
  N = 1K..8K: S and P are N x N per head (O(N^2)); the tiled version holds one tile (O(N)).
- forward (CUDA): TFLOP/s of the Triton kernel vs torch SDPA (flash backend) vs naive.
- paged decode (CUDA): achieved GB/s of paged_decode_attention vs a measured device copy.
- flash decoding (CUDA): split-KV vs no split at batch 1 and a long context.
- MLA decode (CUDA): the latent paged kernel (DeepSeek-V3 shapes) vs the GQA paged kernel, same batch/context.
"""
from __future__ import annotations

import datetime
import math
import platform
import time
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm.auto import tqdm

from llmso_lab.attention import flash_attention_torch, naive_attention
from llmso_lab.models.timing import quiet_c_stderr

__all__ = ["run", "peak_cpu_alloc_bytes"]

MiB, SKIP = 2**20, "skipped: needs CUDA"


def peak_cpu_alloc_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes held by torch's CPU allocator while `fn` runs, above what was live before.

    How: torch.profiler with profile_memory=True records one event per tensor allocation (+bytes) and
    free (-bytes) made by the CPU allocator. Replaying them in time order gives the exact high-water
    mark of live tensor memory. (tracemalloc cannot see these allocations; process RSS would also count
    the allocator's caching and page-granular noise.) The call's output counts while it is alive.
    """
    with quiet_c_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for _, nbytes in sorted(events, key=lambda e: e[0]):  # stable sort keeps same-ns events in order
        live += nbytes
        peak = max(peak, live)
    return peak


def _memory_rows(sizes: list[int], heads: int = 1, head_dim: int = 64, block: int = 256) -> list[dict]:
    """Naive vs tiled attention, fp32, non-causal, one sequence of N tokens.

    The tiled version uses 256 x 256 tiles: its working set is O(block^2) whatever N is, and the fewer,
    larger tiles keep the (per-op) profiler overhead small.
    """
    rows, threads = [], torch.get_num_threads()
    # One thread: the tiled loop runs thousands of tiny ops, where OpenMP workers mostly spin (and crawl
    # when other processes share the cores). Allocations, hence the peaks, do not depend on it.
    torch.set_num_threads(1)
    peak_cpu_alloc_bytes(lambda: None)  # the profiler's first start takes ~1 s: keep it out of the timings
    try:
        for n in tqdm(sizes, desc="attention memory", leave=False):
            rows.append(_memory_row(n, heads, head_dim, block))
    finally:
        torch.set_num_threads(threads)
    return rows


def _memory_row(n: int, heads: int, head_dim: int, block: int) -> dict:
    """One N: peak bytes of naive vs tiled attention on [1, heads, N, head_dim] fp32 inputs."""
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, heads, n, head_dim, generator=g) for _ in range(3))  # [1, H, N, D]
    t0 = time.perf_counter()
    naive = peak_cpu_alloc_bytes(lambda: naive_attention(q, k, v))
    t1 = time.perf_counter()
    flash = peak_cpu_alloc_bytes(lambda: flash_attention_torch(q, k, v, block_q=block, block_k=block))
    t2 = time.perf_counter()
    return {
        "part": "memory", "N": n, "heads": heads, "D": head_dim, "flash_block": block,
        "score_elems_per_head": n * n,  # the lecture: 4K tokens -> 16M per head
        "naive_peak_MiB": round(naive / MiB, 3),
        "naive_expected_MiB": round((2 * heads * n * n + heads * n * head_dim) * 4 / MiB, 3),  # S, P, O
        "flash_peak_MiB": round(flash / MiB, 3),
        "naive_over_flash": round(naive / flash, 1),
        "naive_s": round(t1 - t0, 2), "flash_s": round(t2 - t1, 2),  # 1 thread, profiled: slower than usual
    }


# ---------------------------------------------------------------- CUDA only

def _ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds per call: triton.testing.do_bench on a GPU (CUDA events, L2 flushed between calls)."""
    fn()  # compile / warm up outside the measurement
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40))
    t0 = time.perf_counter()  # CPU: only used to dry-run this code path under the interpreter
    fn()
    return (time.perf_counter() - t0) * 1e3


def _naive_native(q, k, v, causal_mask):
    """Textbook attention in the input dtype (S and P materialised, as a framework would before Flash)."""
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # [B, H, N, N]
    if causal_mask is not None:
        s.masked_fill_(causal_mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _forward_rows(device: torch.device, sizes, dims, dtypes, tokens: int, width: int = 2048) -> list[dict]:
    """Forward TFLOP/s at a fixed token count per batch (batch = tokens // N), heads = width // D."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from llmso_lab.attention import flash_attention

    configs = [(n, d, c, dt) for dt in dtypes for d in dims for c in (False, True) for n in sizes]
    rows = []
    for n, d, causal, dtype in tqdm(configs, desc="attention forward", leave=False):
        b, h = max(1, tokens // n), max(1, width // d)
        q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype) for _ in range(3))  # [B, H, N, D]
        flops = 4 * b * h * n * n * d / (2 if causal else 1)  # two matmuls; causal does half the work
        row = {"part": "forward", "N": n, "D": d, "causal": causal, "dtype": str(dtype).removeprefix("torch."),
               "batch": b, "heads": h}
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        row["max_err_vs_sdpa"] = float((flash_attention(q, k, v, causal)[0] - want).abs().max())

        def sdpa_flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        mask = torch.ones(n, n, dtype=torch.bool, device=device).triu(1) if causal else None
        for name, fn in (("triton", lambda: flash_attention(q, k, v, causal)), ("sdpa_flash", sdpa_flash),
                         ("naive", lambda: _naive_native(q, k, v, mask))):
            try:
                row[f"{name}_tflops"] = round(flops / (_ms(fn, device) * 1e-3) / 1e12, 2)
            except Exception as e:  # e.g. out of memory for naive, or a backend that refuses the shape
                row[f"{name}_tflops"] = f"error: {type(e).__name__}"
        rows.append(row)
        del q, k, v, want, mask
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _copy_gbps(nbytes: int, device: torch.device) -> float:
    """Device memory bandwidth of a plain copy: it reads and writes every byte."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (_ms(lambda: dst.copy_(src), device) * 1e-3) / 1e9


def _decode_rows(device: torch.device, dtype, batch: int, context: int, split_contexts) -> tuple[list[dict], dict]:
    """Paged decode bandwidth vs copy bandwidth; FlashDecoding split vs no split at batch 1."""
    from llmso_lab.attention import flash_decoding, paged_decode_attention

    H, Hkv, D, bs = 32, 8, 128, 16  # a Llama-70B-like layer: 8 KV heads x 128 (the lecture's example)
    rows, ratios = [], {}
    num_blocks = batch * context // bs
    k_cache, v_cache = (torch.randn(num_blocks, bs, Hkv, D, device=device, dtype=dtype) for _ in range(2))
    # Shuffled physical blocks, as after a while of serving: the kernel must follow the table.
    tables = torch.randperm(num_blocks, device=device).view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, H, D, device=device, dtype=dtype)
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    copy_gbps = _copy_gbps(kv_bytes, device)
    for splits in (None, 1):
        ms = _ms(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=splits), device)
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        rows.append({"part": "paged_decode", "batch": batch, "context": context, "block_size": bs,
                     "num_splits": splits or "auto", "ms": round(ms, 4), "GB_s": round(gbps, 1),
                     "copy_GB_s": round(copy_gbps, 1), "fraction_of_copy": round(gbps / copy_gbps, 3)})
    ratios[f"paged_decode_over_copy_bandwidth_{context // 1024}k"] = rows[0]["fraction_of_copy"]
    del k_cache, v_cache

    for n in split_contexts:
        k, v = (torch.randn(1, Hkv, n, D, device=device, dtype=dtype) for _ in range(2))  # [1, Hkv, N, D]
        q1 = torch.randn(1, H, D, device=device, dtype=dtype)
        ms_split = _ms(lambda: flash_decoding(q1, k, v, None), device)
        ms_one = _ms(lambda: flash_decoding(q1, k, v, 1), device)
        nbytes = 2 * k.numel() * k.element_size()
        rows.append({"part": "flash_decoding", "batch": 1, "context": n, "ms_split": round(ms_split, 4),
                     "ms_no_split": round(ms_one, 4), "speedup": round(ms_one / ms_split, 2),
                     "GB_s_split": round(nbytes / (ms_split * 1e-3) / 1e9, 1),
                     "GB_s_no_split": round(nbytes / (ms_one * 1e-3) / 1e9, 1)})
        ratios[f"flash_decoding_split_over_no_split_speed_{n // 1024}k"] = rows[-1]["speedup"]
    return rows, ratios


def _mla_rows(device: torch.device, dtype, batch: int, context: int, heads: int = 128, latent: int = 512,
              rope: int = 64) -> tuple[list[dict], dict]:
    """MLA decode over a paged latent cache (DeepSeek-V3: 128 heads, 512 + 64 latent) vs the GQA paged kernel on
    the lecture's 8 KV heads x 128: bytes read per token and time, same batch and context."""
    from llmso_lab.attention import mla_paged_decode_attention

    bs = 16
    num_blocks = batch * context // bs
    cache = torch.randn(num_blocks, bs, 1, latent + rope, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, device=device).view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, latent + rope, device=device, dtype=dtype)
    nbytes = cache.numel() * cache.element_size()
    ms = _ms(lambda: mla_paged_decode_attention(q, cache, tables, lens, latent, 0.1), device)
    row = {"part": "mla_decode", "batch": batch, "context": context, "heads": heads, "latent": latent + rope,
           "ms": round(ms, 4), "GB_s": round(nbytes / (ms * 1e-3) / 1e9, 1),
           "kv_bytes_per_token_layer": (latent + rope) * cache.element_size()}
    return [row], {f"mla_decode_GB_s_{context // 1024 or context}": row["GB_s"]}


def _gpu_rows(quick: bool, device: torch.device, small: bool = False) -> tuple[list[dict], dict]:
    """All CUDA measurements (small=True: tiny shapes, to dry-run this code on CPU)."""
    if small:
        fwd = _forward_rows(device, [32, 64], [16], [torch.float32], tokens=64, width=32)
        dec, ratios = _decode_rows(device, torch.float32, 2, 64, [128])
        mla, mla_ratios = _mla_rows(device, torch.float32, 2, 64, heads=4, latent=32, rope=8)
    else:
        sizes = [1024, 4096] if quick else [1024, 2048, 4096, 8192, 16384]
        fwd = _forward_rows(device, sizes, [64, 128], [torch.float16] if quick else
                            [torch.float16, torch.bfloat16], tokens=16384)
        dec, ratios = _decode_rows(device, torch.float16, 32, 8192, [16384] if quick else [16384, 65536])
        mla, mla_ratios = _mla_rows(device, torch.float16, 32, 8192)
    ratios.update(mla_ratios)
    if any(r["part"] == "paged_decode" for r in dec):   # the same batch and context in GQA: what MLA saves
        gqa = next(r for r in dec if r["part"] == "paged_decode")
        ratios["mla_over_gqa_decode_time"] = round(mla[0]["ms"] / gqa["ms"], 3)
    dec = dec + mla
    for r in fwd:
        t, ref = r.get("triton_tflops"), r.get("sdpa_flash_tflops")
        if isinstance(t, float) and isinstance(ref, float) and ref > 0:
            key = f"triton_over_sdpa_flash_{r['N'] // 1024 or r['N']}{'k' if r['N'] >= 1024 else ''}" \
                  f"_d{r['D']}_{'causal' if r['causal'] else 'full'}_{r['dtype']}"
            ratios[key] = round(t / ref, 3)
    return fwd + dec, ratios


def _device_name() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    name = f"cpu: {cpu} ({torch.get_num_threads()} threads)"
    if torch.cuda.is_available():
        name = f"cuda: {torch.cuda.get_device_name(0)}; {name}"
    return name


def run(quick: bool = False) -> dict:
    """Run the attention benchmark. quick=True: memory up to N=4K and a reduced GPU sweep."""
    sizes = [1024, 2048, 4096] if quick else [1024, 2048, 4096, 8192]
    table = _memory_rows(sizes)
    ratios = {f"naive_over_flash_peak_mem_{r['N'] // 1024}k": r["naive_over_flash"] for r in table}
    result = {"name": "attention", "device": _device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "llmso-lab bench attention" + (" --quick" if quick else "")}
    if torch.cuda.is_available():
        gpu_rows, gpu_ratios = _gpu_rows(quick, torch.device("cuda"))
        table += gpu_rows
        ratios.update(gpu_ratios)
        result["gpu"] = "measured"
    else:
        table.append({"part": "gpu (forward TFLOP/s, paged decode GB/s, flash decoding)", "status": SKIP})
        result["gpu"] = SKIP
    result.update(table=table, ratios=ratios)
    return result


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(run(quick=True), indent=1))
