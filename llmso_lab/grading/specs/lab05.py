"""Lab 05 (GQA, MQA, MLA: what to store) exercises and their public checks.

References: `llmso_lab.hardware:kv_cache_bytes_of_config` (KV bytes of a Hugging Face config, MLA included),
`llmso_lab.attention.reference:naive_attention` (GQA: query head h reads KV head h // (H / Hkv)),
`llmso_lab.models.kv_heads:mean_pool_kv_heads` (GQA's uptraining init), `llmso_lab.attention.mla:mla_decode_absorbed`
(MLA decode over the latent cache, graded also inside the engine by `engine.mla.decode_exercise`) and `llmso_lab.parallel.heads:kv_bytes_per_rank` (KV per tensor-parallel rank).
Every tensor input is small and built from a seeded generator, so the checks are the same on every machine.
"""
import math

import torch

from llmso_lab.grading.compare import close, exact
from llmso_lab.grading.registry import Case, Exercise, register
from llmso_lab.grading.specs.lab00 import KV_BYTES_ELSEWHERE

rel = close(atol=0.0, rtol=1e-9)      # closed-form byte counts: only float rounding is allowed
fp32 = close(atol=1e-5, rtol=1e-5)    # torch in fp32: only rounding differences
mla_tol = close(atol=1e-4, rtol=1e-4)  # absorbed vs naive MLA: a different summation order over r
ATTENTION_CODE = ("llmso_lab.attention.reference:repeat_kv", "llmso_lab.attention.reference:flash_attention_torch",
                  "llmso_lab.attention.reference:flash_decoding_torch", "llmso_lab.attention.varlen:varlen_attention_torch",
                  "llmso_lab.attention.varlen:paged_attention_torch", "llmso_lab.attention.fallback:flash_attention",
                  "llmso_lab.attention.mla:mla_attention", "torch.nn.functional:scaled_dot_product_attention")

# The library's other attention functions, disabled for MLA too; torch's SDPA stays on there (the engine it runs in
# uses it, and SDPA over the latent cache as one shared KV head IS the absorbed form).
MLA_FREE_ATTENTION = tuple(a for a in ATTENTION_CODE if a != "torch.nn.functional:scaled_dot_product_attention")

# Hugging Face config dicts (the keys `model.config.to_dict()` has), from each model's published config.json
LLAMA3_70B = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192,
              "head_dim": 128}
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
DEEPSEEK_V3 = {"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def qkv(b: int, h: int, hkv: int, nq: int, nk: int, d: int, seed: int):
    """q [B, H, Nq, D], k/v [B, Hkv, Nk, D] in fp32; KV heads far apart, so reading the wrong one shows."""
    k = randn(b, hkv, nk, d, seed=seed + 1) + 2.0 * randn(1, hkv, 1, d, seed=seed + 3)
    v = randn(b, hkv, nk, d, seed=seed + 2) + 2.0 * randn(1, hkv, 1, d, seed=seed + 4)
    return randn(b, h, nq, d, seed=seed), k, v


def mla_inputs(h: int, dn: int, dr: int, dv: int, r: int, s: int, seed: int, scale: float | None = None,
               pe_scale: float = 1.0):
    """One decode token: q_nope [1, H, dn], q_pe [1, H, dr], c_kv [S, r], k_pe [S, dr], w_uk [H, dn, r],
    w_uv [H, dv, r], and the softmax scale (DeepSeek's: 1 / sqrt(dn + dr) unless given)."""
    return (randn(1, h, dn, seed=seed), randn(1, h, dr, seed=seed + 1, scale=pe_scale), randn(s, r, seed=seed + 2),
            randn(s, dr, seed=seed + 3, scale=pe_scale), randn(h, dn, r, seed=seed + 4, scale=r ** -0.5),
            randn(h, dv, r, seed=seed + 5, scale=r ** -0.5), 1.0 / math.sqrt(dn + dr) if scale is None else scale)


register(
    Exercise("kv_cache_size", "05", 10, "llmso_lab.hardware:kv_cache_bytes_of_config", [
        Case("the lecture's 70B: 80 layers x 8 KV heads x 128 x fp16, one token (327,680 B)", (LLAMA3_70B, 1)),
        Case("the same model, an 8K prompt, batch 4", (LLAMA3_70B, 8192), {"batch": 4}),
        Case("SmolLM2-135M in fp32 (no head_dim key: hidden_size / heads)", (SMOLLM2, 1000), {"dtype_bytes": 4}),
        Case("DeepSeek-V3 (MLA): 61 layers x (512 + 64) in bf16, one token", (DEEPSEEK_V3, 1)),
        Case("DeepSeek-V3, 32K tokens x batch 2 in fp8", (DEEPSEEK_V3, 32768), {"batch": 2, "dtype_bytes": 1}),
    ], compare=rel, tripwires=("llmso_lab.hardware:kv_bytes_per_token", *KV_BYTES_ELSEWHERE),
        description="KV-cache bytes of a model given by its HF config (MHA/GQA/MQA, or MLA's latent cache)"),
    Exercise("gqa_attention", "05", 25, "llmso_lab.attention.reference:naive_attention", [
        Case("GQA 4 query heads / 2 KV heads, N=8, causal", qkv(1, 4, 2, 8, 8, 16, seed=10), {"causal": True}),
        Case("6 query heads / 3 KV heads (groups of 2), B=2, not causal", qkv(2, 6, 3, 5, 7, 8, seed=11),
             {"causal": False}),
        Case("decode: 1 query of 8 heads over 12 keys of 2 KV heads, causal (bottom-right)",
             qkv(1, 8, 2, 1, 12, 16, seed=12), {"causal": True}),
    ], compare=fp32, tripwires=ATTENTION_CODE,
        description="causal attention where query head h reads KV head h // (H / Hkv)"),
    Exercise("mean_pool_kv_heads", "05", 20, "llmso_lab.models.kv_heads:mean_pool_kv_heads", [
        Case("k_proj weight of 4 KV heads (D=8, hidden 32) -> 2", (randn(4 * 8, 32, seed=20), 4, 2)),
        Case("6 KV heads (D=4, hidden 10) -> 3: groups of 2", (randn(6 * 4, 10, seed=21), 6, 3)),
        Case("8 KV heads (D=2) -> 2: groups of 4", (randn(8 * 2, 6, seed=22), 8, 2)),
    ], compare=fp32, tripwires=("llmso_lab.models.kv_heads:to_gqa", "llmso_lab.models.kv_heads:to_mqa",
                                "llmso_lab.models.kv_heads:_regroup_heads"),
        description="average groups of consecutive KV heads of a k_proj/v_proj weight (GQA from MHA)"),
    Exercise("mla_decode_absorbed", "05", 40, "llmso_lab.attention.mla:mla_decode_absorbed", [
        Case("H=4, dn=16, dr=8, dv=16, r=32, 10 cached tokens, scale 1/sqrt(dn + dr)",
             ("one token", *mla_inputs(4, 16, 8, 16, 32, 10, seed=30))),
        Case("H=2, dn=8, dr=4, dv=12 (dv != dn), r=24, 7 cached tokens, scale 0.3",
             ("one token", *mla_inputs(2, 8, 4, 12, 24, 7, seed=31, scale=0.3))),
        Case("H=3, dn=16, dr=16, dv=8, r=48, 20 cached tokens, a strong RoPE part",
             ("one token", *mla_inputs(3, 16, 16, 8, 48, 20, seed=32, pe_scale=2.0))),
        Case("in the engine: a tiny DeepSeek-V3 decodes 3 prompts x 8 tokens with your function as its decode "
             "attention; greedy tokens equal the engine's own path and HF generate", ("engine", [5, 17, 33], 8),
             compare=exact()),
    ], harness="llmso_lab.engine.mla:decode_exercise", compare=mla_tol, timeout_s=240,
        tripwires=("llmso_lab.attention.mla:mla_attention", "llmso_lab.attention.mla:mla_paged_decode_torch",
                   "llmso_lab.attention.triton_mla:mla_paged_decode_attention",   # and the kernel it launches
                   "llmso_lab.attention.mla:absorb_query",   # W_UK into the query: half of the absorption
                   "llmso_lab.attention.fallback:mla_paged_decode_attention",
                   "llmso_lab.attention.reference:naive_attention", *MLA_FREE_ATTENTION),
        description="one decode token of MLA over the latent cache [c_kv, k_pe], W_UK in the query, W_UV after; "
                    "then inside the engine's MLA layers"),
    Exercise("kv_bytes_per_rank", "05", 5, "llmso_lab.parallel.heads:kv_bytes_per_rank", [
        Case("Llama-3-70B (64 / 8 heads, 80 layers, 128) fp16 at TP 16: KV heads replicated", (80, 64, 8, 128, 16)),
        Case("SmolLM2 (9 / 3 heads, 30 layers, 64) fp32 at TP 9", (30, 9, 3, 64, 9), {"dtype_bytes": 4}),
        Case("Qwen2.5-7B (28 / 4 heads, 28 layers, 128) at TP 28", (28, 28, 4, 128, 28)),
        Case("Llama-3-70B at TP 4: KV heads split", (80, 64, 8, 128, 4)),
    ], compare=rel, tripwires=("llmso_lab.parallel.heads:shard_heads", "llmso_lab.parallel.heads:valid_tp_sizes",
                               "llmso_lab.parallel.heads:HeadShard.kv_fraction_per_rank"),
        description="KV-cache bytes per token on each tensor-parallel rank (KV heads replicated past TP = Hkv)"),
)
