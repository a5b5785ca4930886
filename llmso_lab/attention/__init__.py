"""Attention for serving: torch references (the oracles) and Triton kernels (lecture section 1-2).

- reference: naive N x N attention, FlashAttention's online softmax in torch, the split merge rule.
- varlen: packed variable-length batches (cu_seqlens) and the paged KV cache, in torch.
- triton_flash / triton_decode / triton_paged / triton_mla: FlashAttention forward, FlashDecoding,
  PagedAttention, and MLA decode over a latent paged cache (`mla` holds its torch references).

On CPU the kernels run under the Triton interpreter (set TRITON_INTERPRET=1 before they are first used);
where Triton is not installed (macOS, Windows) the kernel names fall back to the torch references.
"""
import importlib

from .backend import interpreter_enabled, triton_available
from .reference import (
    causal_mask, flash_attention_torch, flash_decoding_torch, merge_attention_states, naive_attention,
    online_softmax_update, repeat_kv,
)
from .varlen import build_cu_seqlens, gather_paged_kv, paged_attention_torch, varlen_attention_torch

__all__ = [
    "triton_available", "interpreter_enabled",
    "naive_attention", "online_softmax_update", "flash_attention_torch", "merge_attention_states",
    "flash_decoding_torch", "repeat_kv", "causal_mask",
    "build_cu_seqlens", "varlen_attention_torch", "gather_paged_kv", "paged_attention_torch",
    "flash_attention", "flash_decoding", "paged_decode_attention", "mla_paged_decode_attention",
]

_KERNEL_MODULES = {"flash_attention": "triton_flash", "flash_decoding": "triton_decode",
                   "paged_decode_attention": "triton_paged", "mla_paged_decode_attention": "triton_mla"}


def __getattr__(name: str):
    """Import the kernels on first use (PEP 562): importing this package stays cheap, does not import
    triton, and TRITON_INTERPRET only has to be set before the first kernel is touched."""
    if name not in _KERNEL_MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _KERNEL_MODULES[name] if triton_available() else "fallback"
    fn = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = fn
    return fn
