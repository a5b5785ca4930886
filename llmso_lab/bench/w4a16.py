"""`llmso-lab bench w4a16`: the Triton W4A16 kernel on a GPU (part of `make gpu-bench`).

Times y = x @ W^T for SmolLM2's and Llama-3-8B's matrix shapes at batch 1, 16 and 256 with W in fp16 (cuBLAS),
as int4 dequantized to fp16 first and then multiplied (what a kernel without fused unpacking must do), and as
int4 read packed by `llmso_lab.quant.triton_w4a16`. At batch 1 the matmul is bound by the bytes it reads:
int4 reads ~1/4 of fp16's (plus scales), so the fused kernel can approach 3-4x; at batch 256 it is compute bound
and unpacking costs more than it saves. Without CUDA it dry-runs the same code on tiny shapes under the
interpreter (times meaningless) and reports the GPU rows as skipped.
"""
from __future__ import annotations

import datetime

import torch

from llmso_lab.bench.attention import SKIP, _device_name, _ms
from llmso_lab.quant.rtn import quantize
from llmso_lab.quant.triton_w4a16 import w4a16_matmul, w4a16_reference

SHAPES = {"smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
          "llama3-8b qkv": (6144, 4096), "llama3-8b gate_up": (28672, 4096), "llama3-8b down": (4096, 14336)}


def kernel_rows(device: torch.device, shapes: dict[str, tuple[int, int]], batches: list[int], group_size: int = 64) -> tuple[list[dict], dict]:
    """One row per (shape, batch): ms and GB/s for fp16, dequantize+matmul, fused W4A16; the fused kernel's error."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32   # the interpreter: fp32
    rows, ratios = [], {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.02
        qt = quantize(w, 4, group_size=group_size, symmetric=False)
        packed, scale, minimum = qt.packed.to(device), qt.scale.to(device, dtype), qt.minimum.to(device, dtype)
        w16 = w.to(device, dtype)
        for m in batches:
            x = torch.randn(m, k, device=device, dtype=dtype)
            err = (w4a16_matmul(x, packed, scale, minimum, group_size).float()
                   - w4a16_reference(x, packed, scale, minimum, group_size).float()).abs().max().item()
            t_fp16 = _ms(lambda: x @ w16.t(), device)
            t_deq = _ms(lambda: w4a16_reference(x, packed, scale, minimum, group_size), device)
            t_w4 = _ms(lambda: w4a16_matmul(x, packed, scale, minimum, group_size), device)
            w4_bytes = packed.numel() + 2 * 2 * scale.numel()
            rows.append({"part": "w4a16", "shape": name, "N": n, "K": k, "M": m, "fp16_ms": round(t_fp16, 4),
                         "dequant_then_mm_ms": round(t_deq, 4), "w4a16_ms": round(t_w4, 4),
                         "w4a16_GB_s": round(w4_bytes / t_w4 / 1e6, 1), "max_err": float(f"{err:.3g}")})
            ratios[f"w4a16_over_fp16_speed_{name.replace(' ', '_')}_m{m}"] = round(t_fp16 / t_w4, 3)
    return rows, ratios


def run(quick: bool = False) -> dict:
    result = {"name": "w4a16", "device": _device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "llmso-lab bench w4a16" + (" --quick" if quick else "")}
    if torch.cuda.is_available():
        shapes = dict(list(SHAPES.items())[:3]) if quick else SHAPES
        table, ratios = kernel_rows(torch.device("cuda"), shapes, [1, 16] if quick else [1, 16, 256])
        result["gpu"] = "measured"
    else:
        table, ratios = [{"part": "w4a16 (fp16 vs dequantize+matmul vs fused int4, ms)", "status": SKIP}], {}
        result["gpu"] = SKIP
    result.update(table=table, ratios=ratios)
    return result
