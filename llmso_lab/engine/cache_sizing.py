"""Model-shape functions the engine sizes itself with: which models it runs, per-layer sliding windows, and the bytes
of one KV block (plain, MLA latent, quantized, per tensor-parallel rank). A leaf module: `EngineConfig` sizes the
cache from these before any model runner exists, and the runner and the benches use the same numbers.
"""
from __future__ import annotations

import torch

from llmso_lab import hardware as hw
from llmso_lab.kv.quant import QuantizedPagedKV, kv_bytes_per_token

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "deepseek_v3")


def check_model_config(cfg) -> None:
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {cfg.model_type!r} is not supported; valid: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported; the engine implements SwiGLU (silu)")
    if cfg.model_type == "deepseek_v3":
        if cfg.first_k_dense_replace < cfg.num_hidden_layers:
            raise ValueError(f"this DeepSeek config has MoE layers (first_k_dense_replace={cfg.first_k_dense_replace} < "
                             f"num_hidden_layers={cfg.num_hidden_layers}); the engine serves MLA with dense MLPs: set "
                             "first_k_dense_replace = num_hidden_layers")
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"MLA with rope_type {rope.get('rope_type')!r} is not supported; use rope_scaling=None")


def sliding_windows(cfg, max_model_len: int) -> list[int | None]:
    """Per-layer sliding window (None = full attention); a window that covers max_model_len is dropped."""
    window = getattr(cfg, "sliding_window", None)
    if window is None or window >= max_model_len:
        return [None] * cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    return [window if t == "sliding_attention" else None for t in types] if types else [window] * cfg.num_hidden_layers


def kv_cache_bytes_per_block(cfg, block_size: int, dtype: torch.dtype, tp: int = 1, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV block (`block_size` tokens, every layer) on one rank: `hardware.kv_cache_bytes` over the
    rank's KV heads (`parallel.heads.shard_heads` at tensor-parallel size `tp`), or its MLA form (one latent
    [c_kv, k_pe] per token and layer, no separate V). A quantized `kv_cache_dtype`: what the store's own per-block
    tensors (codes, scales, zero points) take (`kv.quant.kv_bytes_per_token`)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    if kv_cache_dtype != "auto":
        per_token = kv_bytes_per_token(kv_cache_dtype, cfg.num_key_value_heads, head_dim_of(cfg), cfg.num_hidden_layers,
                                       block_size, dtype)
        return round(per_token * block_size)
    if cfg.model_type == "deepseek_v3":
        return hw.mla_kv_cache_bytes(cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, elem, block_size)
    head_dim = head_dim_of(cfg)
    kv_heads = cfg.num_key_value_heads
    if tp > 1:
        from llmso_lab.parallel.heads import shard_heads
        kv_heads = shard_heads(cfg.num_attention_heads, kv_heads, tp).kv_heads_per_rank
    return hw.kv_cache_bytes(cfg.num_hidden_layers, kv_heads, head_dim, elem, block_size)


def kv_cache_fixed_bytes(cfg, block_size: int, dtype: torch.dtype, kv_cache_dtype: str, num_window_blocks: int) -> int:
    """Bytes of a quantized cache that do not grow with its blocks (KIVI's window pool, FP8's static scales),
    measured on a store built on the meta device (no memory)."""
    store = QuantizedPagedKV(kv_cache_dtype, cfg.num_hidden_layers, 1, block_size, cfg.num_key_value_heads,
                             head_dim_of(cfg), dtype, num_window_blocks=num_window_blocks, device="meta")
    return store.fixed_bytes()


def head_dim_of(cfg) -> int:
    """Per-head dimension: the config's `head_dim`, else hidden_size / num_attention_heads."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
