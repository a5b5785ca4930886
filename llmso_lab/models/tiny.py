"""Tiny seeded random Hugging Face models for fast tests: same seed -> same weights on every machine."""
from __future__ import annotations

import torch


def _seeded(build, seed: int, dtype: torch.dtype):
    # Initialise under a private generator state so the caller's RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    return model.to(dtype).eval()


def tiny_llama(num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
               vocab_size: int = 256, intermediate_size: int | None = None, max_position_embeddings: int = 2048,
               tie_word_embeddings: bool = True, initializer_range: float = 0.2, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random `LlamaForCausalLM` (GQA when num_kv_heads < num_heads), tied head like SmolLM2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or 4 * hidden_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=initializer_range,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager",
    )
    return _seeded(lambda: LlamaForCausalLM(cfg), seed, dtype)


def tiny_mixtral(num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                 num_experts: int = 4, experts_per_token: int = 2, vocab_size: int = 256,
                 intermediate_size: int | None = None, initializer_range: float = 0.2, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
    """A random `MixtralForCausalLM` (sparse MoE) for expert-parallel exercises."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or 2 * hidden_size, num_local_experts=num_experts,
        num_experts_per_tok=experts_per_token, max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=initializer_range,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager",
    )
    return _seeded(lambda: MixtralForCausalLM(cfg), seed, dtype)
