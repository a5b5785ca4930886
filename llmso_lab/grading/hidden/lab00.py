"""Hidden checks for Lab 00 (instructor only; not in the student bundle)."""
from llmso_lab.grading.registry import hidden

hidden("00", {
    "matmul_arithmetic_intensity": [((8, 8192, 8192), {"bytes_per_elem": 2}), ((2048, 128, 2048), {"bytes_per_elem": 1}),
                                    ((1, 1, 1), {"bytes_per_elem": 4})],
    "roofline_time": [((0.0, 5e9, 1e12, 1e11), {}), ((7e12, 7.0, 1e12, 1e9), {}), ((3e14, 3e11, 3e14, 3e11), {})],
    "compute_bound_tokens": [((35e9, 140e9, 989e12, 3.35e12), {}),          # int4 weights: a quarter of the fp16 tokens
                             ((16e9, 16e9, 121e12, 300e9), {}),             # 8B fp16 on an L4
                             ((1.0, 4.0, 10.0, 5.0), {})],
    "kv_bytes_per_token": [((32, 8, 128), {"bytes_per_elem": 2}), ((61, 1, 576), {"bytes_per_elem": 1}),
                           ((1, 1, 1), {"bytes_per_elem": 0.5})],
    "decode_tokens_per_s_bound": [((16e9, 1e12), {"batch": 64, "context_len": 2048, "kv_bytes_per_token": 131072}),
                                  ((538e6, 28e9), {}), ((2e9, 3e11), {"batch": 3, "context_len": 10,
                                                                       "kv_bytes_per_token": 7}),
                                  ((0.0, 1e9), {"batch": 2, "context_len": 100, "kv_bytes_per_token": 50})],
    "precision_speedup": [((64, 134.5e6, 4, 2, 0.28e12, 2.8e12, 25e9), {}),     # compute-bound in fp32, memory-bound in bf16
                          ((512, 8e9, 2, 1, 989e12, 1979e12, 3.35e12), {}),     # W8A8 prefill on an H100
                          ((1000, 1e6, 4, 2, 2e11, 1e11, 1e10), {}),            # emulated bf16: slower math (< 1)
                          ((1, 1e6, 2, 2, 1e12, 5e11, 1e9), {})],               # nothing changes for decode: 1.0
})
