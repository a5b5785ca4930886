"""Torch stand-ins for the Triton entry points, used where Triton is missing (e.g. macOS, Windows).

Same signatures and results as the kernels in triton_flash / triton_decode / triton_paged; each warns once.
"""
from __future__ import annotations

import torch

from .backend import warn_fallback
from .mla import mla_paged_decode_torch
from .reference import flash_attention_torch, flash_decoding_torch
from .varlen import paged_attention_torch, varlen_attention_torch

__all__ = ["flash_attention", "flash_decoding", "paged_decode_attention", "mla_paged_decode_attention"]


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    cu_seqlens: torch.Tensor | None = None, *, cu_seqlens_q: torch.Tensor | None = None,
                    cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                    scale: float | None = None, block_m: int | None = None, block_n: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch fallback of triton_flash.flash_attention (dense or varlen)."""
    warn_fallback("flash_attention")
    if cu_seqlens is not None or cu_seqlens_q is not None:
        cu_q = cu_seqlens if cu_seqlens_q is None else cu_seqlens_q
        return varlen_attention_torch(q, k, v, cu_q, cu_seqlens_k, causal=causal, scale=scale)
    return flash_attention_torch(q, k, v, causal, block_q=block_m or 64, block_k=block_n or 64, scale=scale)


def flash_decoding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_splits: int | None = None,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch fallback of triton_decode.flash_decoding."""
    warn_fallback("flash_decoding")
    return flash_decoding_torch(q, k, v, num_splits or 1, scale=scale)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float | None = None,
                           num_splits: int | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch fallback of triton_paged.paged_decode_attention (num_splits does not change the result)."""
    warn_fallback("paged_decode_attention")
    if k_scale is not None:   # an int8 cache: dequantize it whole
        k_cache = (k_cache.float() * k_scale.float()[..., None]).to(q.dtype)
        v_cache = (v_cache.float() * v_scale.float()[..., None]).to(q.dtype)
    return paged_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale=scale)


def mla_paged_decode_attention(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, latent_dim: int, scale: float,
                               num_splits: int | None = None) -> torch.Tensor:
    """Torch fallback of triton_mla.mla_paged_decode_attention."""
    warn_fallback("mla_paged_decode_attention")
    return mla_paged_decode_torch(q, latent_cache, block_tables, context_lens, latent_dim, scale)
