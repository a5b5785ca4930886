"""Hidden checks for Lab 05 (instructor only; not in the student bundle): other shapes, MQA/MHA edges, DeepSeek sizes."""
from llmso_lab.grading.compare import exact
from llmso_lab.grading.registry import Case, hidden
from llmso_lab.grading.specs.lab05 import DEEPSEEK_V3, LLAMA3_70B, SMOLLM2, mla_inputs, qkv, randn

MISTRAL_7B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
              "head_dim": None}
GEMMA_LIKE = {"num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1, "hidden_size": 2048,
              "head_dim": 256}   # MQA, head_dim given and != hidden / heads
DEEPSEEK_V2_LITE = {"num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_size": 2048,
                    "kv_lora_rank": 512, "qk_rope_head_dim": 64}
MHA_NO_KV_KEY = {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768}   # GPT-2-like: no KV key

hidden("05", {
    "kv_cache_size": [
        ((MISTRAL_7B, 4096), {"batch": 3}),
        ((GEMMA_LIKE, 1000), {"dtype_bytes": 2}),
        ((DEEPSEEK_V2_LITE, 4096), {"batch": 5}),
        ((MHA_NO_KV_KEY, 1024), {"dtype_bytes": 4}),
        ((SMOLLM2, 2048), {"batch": 16, "dtype_bytes": 2}),
        ((DEEPSEEK_V3, 128 * 1024), {}),
        ((LLAMA3_70B, 131072), {"dtype_bytes": 1}),
    ],
    "gqa_attention": [
        (qkv(2, 8, 2, 9, 9, 8, seed=100), {"causal": True}),      # groups of 4
        (qkv(1, 12, 4, 5, 20, 16, seed=101), {"causal": True}),   # 5 queries after 15 cached keys
        (qkv(1, 6, 3, 16, 16, 64, seed=102), {"causal": False}),  # D=64
        (qkv(3, 9, 3, 1, 33, 8, seed=103), {"causal": True}),     # SmolLM2's 9/3 heads, decode
        (qkv(1, 16, 8, 4, 4, 4, seed=104), {"causal": True}),     # Llama's 8 KV heads, groups of 2
    ],
    "mean_pool_kv_heads": [
        ((randn(12 * 2, 5, seed=110), 12, 4), {}),      # groups of 3
        ((randn(8 * 16, 64, seed=111), 8, 4), {}),      # Llama-like D
        ((randn(4 * 8, seed=112), 4, 2), {}),           # a bias [Hkv * D]
        ((randn(6 * 3, 7, seed=113), 6, 2), {}),        # groups of 3
        ((randn(9 * 64, 24, seed=114), 9, 3), {}),      # SmolLM2-as-MHA back to 3 heads
    ],
    "mla_decode_absorbed": [
        (("one token", *mla_inputs(8, 32, 16, 32, 64, 37, seed=120)), {}),
        (("one token", *mla_inputs(16, 128, 64, 128, 512, 24, seed=121)), {}),        # DeepSeek's per-head sizes
        (("one token", *mla_inputs(4, 16, 8, 16, 32, 50, seed=122, pe_scale=3.0)), {}),  # RoPE part dominates
        (("one token", *mla_inputs(5, 24, 8, 20, 40, 13, seed=123, scale=0.05)), {}),  # a small scale (flat softmax)
        (("one token", *mla_inputs(1, 8, 4, 8, 16, 64, seed=124)), {}),                 # one head
        Case("engine, another random model: a long and a short prompt", ("engine", [40, 3], 6, 5), compare=exact(),
             hidden=True),
    ],
    "kv_bytes_per_rank": [
        ((80, 64, 8, 128, 8), {}),
        ((80, 64, 8, 128, 32), {"dtype_bytes": 1}),
        ((30, 9, 3, 64, 3), {"dtype_bytes": 4}),
        ((32, 32, 8, 128, 1), {}),
        ((28, 28, 4, 128, 2), {}),
        ((61, 128, 128, 192, 16), {}),   # MHA: 8 KV heads per rank
    ],
})
