"""The launcher of Lab 03's FlashAttention exercise: grid, tile sizes and arguments for a tile kernel.

The kernel (`_attn_fwd_tile_kernel` in the notebook) computes one BLOCK_M tile of queries of one (batch,
head) over all its keys. The notebook's `flash_attention` launches the student's kernel with this function,
and the grader launches it the same way, so what is graded is exactly what the kernel computes. The
library's own, more general kernel is `triton_flash.py`.
"""
from __future__ import annotations

import math

import torch

__all__ = ["launch_attn_fwd_tile"]


def launch_attn_fwd_tile(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `kernel` over q [B, H, Nq, D], k/v [B, Hkv, Nk, D] -> (o [B, H, Nq, D], lse [B, H, Nq] fp32)."""
    import triton

    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if H % Hkv or D < 16 or D & (D - 1):
        raise ValueError(f"needs Hkv | H and a power-of-two head dim >= 16; got H={H}, Hkv={Hkv}, D={D}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # NaN until the kernel writes them: an output the kernel never stores shows up as NaN, not as stale memory
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, Nq), float("nan"), dtype=torch.float32, device=q.device)
    # GPU: 64-wide tiles for the tensor cores. Interpreter: no wider than needed (numpy computes every padded row).
    block_m = 64 if q.is_cuda else max(16, min(64, triton.next_power_of_2(Nq)))
    block_n = 64 if q.is_cuda else max(16, min(64, triton.next_power_of_2(Nk)))
    grid = (triton.cdiv(Nq, block_m), B * H)  # one program per (query tile, batch * head)
    try:
        kernel[grid](
            q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            Nq, Nk, H, H // Hkv, 1.0 / math.sqrt(D),
            CAUSAL=causal, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D,
        )
    except Exception as exc:  # Triton wraps errors raised inside a kernel; say plainly when it is the stub
        if "NotImplementedError" in str(exc):
            raise NotImplementedError("complete the loop body of the kernel") from None
        raise
    return o, lse
