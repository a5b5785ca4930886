"""W4A16 matmul in Triton: y = x @ W^T with W stored as int4 codes (two per byte) and per-group scale and minimum.

The idea behind Marlin and gpt-fast's int4 kernels: never build the fp16 weight matrix in memory. Each program
loads a [BLOCK_K, BLOCK_N] tile of *packed bytes* (a quarter of the fp16 tile's bytes), unpacks the nibbles in
registers, applies its group's scale and minimum, and feeds the tile to `tl.dot`. At batch 1 the kernel is bound by
how fast it reads weights, so reading 4x fewer bytes than fp16 is the whole speed-up (Lab 00's roofline).

Layout (`llmso_lab.quant.rtn`): codes [N, K] packed little-endian, byte [n, k // 2] holds k even in its low nibble;
W[n, k] = code * scale[n, k // G] + minimum[n, k // G]. Tiles never straddle a group: BLOCK_K divides G.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmso_lab.attention.triton_common import dot_precision

__all__ = ["w4a16_matmul", "w4a16_reference"]


@triton.jit
def _w4a16_kernel(X, P, S, MN, Y, M, N, K, G,
                  stride_xm, stride_pn, stride_sn, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k                                                              # [BK]
        x = tl.load(X + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)   # [BM, BK]
        # two neighbouring k read the same byte; the shift picks its nibble (low nibble = even k)
        byte = tl.load(P + offs_n[None, :] * stride_pn + (k // 2)[:, None], mask=n_ok[None, :], other=0)  # [BK, BN]
        code = (byte.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF
        g = k0 // G                                                                  # the tile's one group
        scale = tl.load(S + offs_n * stride_sn + g, mask=n_ok, other=0.0)            # [BN]
        minimum = tl.load(MN + offs_n * stride_sn + g, mask=n_ok, other=0.0)
        w = (code.to(tl.float32) * scale[None, :].to(tl.float32) + minimum[None, :].to(tl.float32)).to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION)                              # [BM, BN]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                 group_size: int, block_n: int = 64) -> torch.Tensor:
    """x [M, K] (fp16 / fp32) @ W^T -> [M, N] in x's dtype; packed uint8 [N, K/2]; scale, minimum [N, K/G]."""
    M, K = x.shape
    N = packed.shape[0]
    if packed.shape[1] * 2 != K or scale.shape != (N, K // group_size) or minimum.shape != scale.shape:
        raise ValueError(f"shapes do not agree: x {tuple(x.shape)}, packed {tuple(packed.shape)} (want [N, K/2]), "
                         f"scale {tuple(scale.shape)} and minimum {tuple(minimum.shape)} (want [N, K/{group_size}])")
    if K % group_size or group_size < 16:
        raise ValueError(f"group_size={group_size} must divide K={K} and be >= 16 (tl.dot's smallest K tile)")
    x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = max(16, min(64, triton.next_power_of_2(M)))
    block_k = min(group_size, 64)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w4a16_kernel[grid](x, packed.contiguous(), scale.contiguous(), minimum.contiguous(), y, M, N, K, group_size,
                        x.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(x.dtype))
    return y


def w4a16_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """Dequantize then matmul, in fp32: what `w4a16_matmul` must equal."""
    from llmso_lab.quant.rtn import unpack_bits
    N, K = packed.shape[0], packed.shape[1] * 2
    codes = unpack_bits(packed, 4, K).float().reshape(N, -1, group_size)
    w = (codes * scale.float()[..., None] + minimum.float()[..., None]).reshape(N, K)
    return (x.float() @ w.t()).to(x.dtype)
