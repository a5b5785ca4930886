"""Hidden checks for Lab 09 (instructor only; not in the student bundle): other models, layer timings and sizes."""
from llmso_lab.grading.registry import hidden
from llmso_lab.grading.specs.lab05 import DEEPSEEK_V3, LLAMA3_70B, SMOLLM2
from llmso_lab.grading.specs.lab09 import GEMMA2_9B, LLAMA2_7B, MS

QWEN25_7B = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
             "head_dim": None}   # head_dim None (as to_dict() gives it): 3584 / 28 = 128
FALCON_7B_LIKE = {"num_hidden_layers": 32, "num_attention_heads": 71, "num_key_value_heads": 1, "hidden_size": 4544}
DEEPSEEK_V2_LITE = {"num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_size": 2048,
                    "kv_lora_rank": 512, "qk_rope_head_dim": 64}
GPT2_LIKE = {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768}

_D = [(13 * i + 7) % 240 + 3 for i in range(21)]

hidden("09", {
    "write_received_kv": [
        (([_D, _D[:16] + [9, 9, 9]], 6, True, False, 8), {}),   # block size 8: 2 cached blocks of 8, start 16
        (([list(range(20, 25)), _D, [4, 5]], 7, False, True), {}),
    ],
    "kv_transfer_bytes": [((QWEN25_7B, 3000, 1000), {}), ((FALCON_7B_LIKE, 777), {"dtype_bytes": 4}),
                          ((DEEPSEEK_V2_LITE, 2048, 512), {}), ((DEEPSEEK_V3, 32768), {"dtype_bytes": 1}),
                          ((GPT2_LIKE, 1), {}), ((GEMMA2_9B, 4096, 4095), {}),
                          ((LLAMA2_7B, 64, 64), {"dtype_bytes": 4}),   # fully cached
                          ((SMOLLM2, 1), {"num_cached_tokens": 0, "dtype_bytes": 1}),
                          ((LLAMA3_70B, 131072, 65536), {})],
    "exposed_transfer_time": [
        (([0.5 * MS] * 30, [0.5 * MS] * 30), {}),                                 # link exactly as fast as compute
        (([0.5 * MS] * 30, [0.6 * MS] * 30), {}),                                 # slightly slower: +0.1 ms backlog per layer
        (([0.0] * 5, [MS, 2 * MS, 3 * MS, 4 * MS, 5 * MS]), {}),                  # no compute: all of it exposed
        (([4 * MS, MS, MS, MS], [3 * MS, 0.1 * MS, 0.1 * MS, 0.1 * MS]), {}),    # first layer's transfer overhangs
        (([MS, 3 * MS, MS], [2 * MS, 0.5 * MS, 2 * MS]), {"layerwise": False}),
        (([2 * MS], [5 * MS]), {"layerwise": False}),
        (([14 * MS] * 80, [0.67 * MS] * 80), {}),                                # Llama-3-70B, 8K prompt, fast link
        (([MS, 0.1 * MS, 0.1 * MS, 0.1 * MS, MS, 0.1 * MS], [0.8 * MS, 0.9 * MS, 0.2 * MS, 0.0, 1.5 * MS, 0.4 * MS]),
         {"layerwise": True}),
    ],
    "best_pd_ratio": [((3, 4000, 100, 20000.0, 2000.0), {}), ((100, 4000, 100, 20000.0, 2000.0), {}),
                      ((100, 200, 2000, 8000.0, 4000.0), {}), ((9, 2048, 256, 4096.0, 1024.0), {}),
                      ((4, 2048, 256, 4096.0, 1024.0), {}),   # tie: (2, 2) and (3, 1) both serve 4/s
                      ((7, 512, 512, 2048.0, 2048.0), {}),   # tie: (3, 4) and (4, 3)
                      ((16, 3000, 300, 12345.0, 987.0), {}),
                      ((2, 1, 1, 1.0, 1.0), {})],
    "pd_route": [((8000, 0, [900, 100, 100, 100, 4000]), {"max_local_prefill_tokens": 512}),
                 ((513, 0, [6, 5]), {"max_local_prefill_tokens": 512}),
                 ((512, 0, [6, 5]), {"max_local_prefill_tokens": 512}),
                 ((9000, 8000, [0, 0]), {"max_local_prefill_tokens": 2048}),
                 ((9000, 4000, [3000, 2500, 8000]), {"max_local_prefill_tokens": 2048,
                                                     "max_prefill_queue_tokens": 2500}),
                 ((9000, 4000, [3000, 2499, 8000]), {"max_local_prefill_tokens": 2048,
                                                     "max_prefill_queue_tokens": 2500}),
                 ((50, 0, [0]), {"max_prefill_queue_tokens": 0}),
                 ((50, 50, [0, 0, 0]), {}),
                 ((4000, 0, [7, 7, 7, 7]), {"max_local_prefill_tokens": 256, "max_prefill_queue_tokens": None}),
                 ((4000, 0, []), {"max_local_prefill_tokens": 0, "max_prefill_queue_tokens": 10})],
})
