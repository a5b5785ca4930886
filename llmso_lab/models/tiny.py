"""Tiny seeded random Hugging Face models for fast tests: same seed -> same weights on every machine."""
from __future__ import annotations

import threading

import torch

_GLOBAL_RNG = threading.Lock()   # Hugging Face initialises weights from torch's global generator


def _seeded(build, seed: int, dtype: torch.dtype):
    # Initialise under a private generator state so the caller's RNG is untouched; one build at a time, so that two
    # threads (the grader judges two mechanism exercises at once, `grading.judge`) cannot interleave their draws.
    with _GLOBAL_RNG, torch.random.fork_rng(devices=[]):
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


def tiny_deepseek_v3(num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4, kv_lora_rank: int = 32,
                     q_lora_rank: int | None = None, qk_nope_head_dim: int = 16, qk_rope_head_dim: int = 8,
                     v_head_dim: int = 16, vocab_size: int = 256, rope_interleave: bool = True,
                     initializer_range: float = 0.2, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random `DeepseekV3ForCausalLM` with MLA attention and dense MLPs only (first_k_dense_replace =
    num_layers): the latent KV cache is kv_lora_rank + qk_rope_head_dim numbers per token and layer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        moe_intermediate_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
        first_k_dense_replace=num_layers, n_routed_experts=4, num_experts_per_tok=2, rope_scaling=None,
        rope_interleave=rope_interleave, max_position_embeddings=2048, initializer_range=initializer_range,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager",
    )
    return _seeded(lambda: DeepseekV3ForCausalLM(cfg), seed, dtype)
