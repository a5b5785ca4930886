"""Hidden checks for Lab 10 (instructor only; not in the student bundle): other shapes, bits, budgets and depths."""
from llmso_lab.grading.registry import hidden
from llmso_lab.grading.specs.lab10 import h2o_scores, kivi_inputs, snapkv_inputs

_hot_early = h2o_scores(2, 40, seed=1060, budget=16, recent=8, causal=False)
_hot_early[:, 32:] = 3.0   # the whole recent window scores highest (and ties): heavy hitters still come from 0-31

hidden("10", {
    "kivi_fake_quantize": [
        (kivi_inputs(64, 3, 32, 4, 16, 16, seed=1001, outliers=(1, 7, 30)), {}),    # 48 quantized, 3 groups
        (kivi_inputs(50, 1, 16, 2, 12, 5, seed=1002), {}),                         # 45 -> 36 quantized, 14 exact
        (kivi_inputs(33, 2, 8, 8, 32, 0, seed=1003), {}),                          # 8-bit, one group + 1 exact
        (kivi_inputs(7, 2, 4, 2, 8, 0, seed=1004), {}),                            # T < group_size: nothing quantized
        (kivi_inputs(20, 4, 8, 4, 4, 3, seed=1005, constant=True), {}),            # constant channel / token, groups of 4
        (kivi_inputs(32, 2, 16, 4, 16, 16, seed=1006, outliers=()), {}),           # T - R = one group exactly
        (kivi_inputs(40, 2, 8, 2, 8, 7, seed=1007), {}),                           # T - R = 33 -> 32
    ],
    "streaming_keep": [
        ((1000, 64), {}), ((2048, 256, 1), {}), ((9, 5, 0), {}), ((5, 5, 4), {}), ((6, 5), {}),
        ((300, 300, 8), {}), ((1, 1, 0), {}), ((1, 8), {}), ((64, 9, 8), {}),
    ],
    "h2o_keep": [
        ((h2o_scores(6, 48, seed=1010, budget=16, recent=8), 16, 8), {}),
        ((h2o_scores(2, 64, seed=1020, budget=9, recent=1, causal=False), 9, 1), {}),
        ((h2o_scores(1, 10, seed=1030, budget=3, recent=0), 3, 0), {}),
        ((h2o_scores(4, 30, seed=1040, budget=29, recent=5, causal=False), 29, 5), {}),   # drops one token per head
        ((h2o_scores(3, 16, seed=1050, budget=16, recent=0), 16, 0), {}),
        ((_hot_early, 16, 8), {}),
        ((h2o_scores(2, 12, seed=1070, budget=6, recent=6), 6, 6), {}),                  # recent only
    ],
    "snapkv_keep": [
        (snapkv_inputs(8, 2, 96, 16, 32, 16, 7, seed=1100), {}),    # 4 query heads per KV head
        (snapkv_inputs(3, 3, 30, 8, 10, 3, 3, seed=1200), {}),      # MHA, 3 heads
        (snapkv_inputs(6, 3, 50, 8, 20, 5, 9, seed=1300), {}),      # GQA 6/3, wide kernel
        (snapkv_inputs(2, 1, 24, 4, 23, 4, 5, seed=1400), {}),      # drops one token
        (snapkv_inputs(4, 2, 36, 8, 6, 6, 3, seed=1500), {}),       # budget = window: the window only
        (snapkv_inputs(6, 2, 20, 8, 40, 8, 7, seed=1600), {}),      # budget > T
        (snapkv_inputs(9, 3, 64, 8, 24, 1, 5, seed=1700), {}),      # window of one query
    ],
    "StreamingEvictionPolicy": [
        (([[(5 * i + 11) % 240 + 3 for i in range(45)]], 10, 1, 2, 8, 16), {}),   # 45-token prompt, 16-token steps
        (([list(range(3, 9)), list(range(60, 73)), list(range(100, 104))], 25, 1, 1, 12), {}),   # window of one block
        (([list(range(3, 21))], 30, 3, 2, 10), {}),                               # 3 sink blocks
        (([list(range(3, 30))], 12, 2, 1, 12, 4), {}),   # 4-token chunks under 2 sinks: the cap's floor is the sinks
    ],
    "cacheblend_select": [
        ((0.15, 11), {"chunk_lens": (12, 30, 8, 20)}),
        ((0.6, 12), {}),
        ((0.05, 13), {"on": "k", "chunk_lens": (64,)}),
        ((0.5, 14), {"chunk_lens": (40, 9)}),   # 24.5 tokens: half-way, rounds up to 25 (round() would say 24)
        ((0.25, 15), {"chunk_lens": (10,)}),    # 2.5 tokens: 3 (round() would say 2)
    ],
    "pyramid_budgets": [
        ((30, 30 * 128), {}), ((30, 1234, 10), {}), ((24, 24 * 64, 1), {}), ((32, 4097, 20), {}),
        ((2, 2), {"beta": 1}), ((3, 100, 3.5), {}), ((16, 16 * 7 + 5, 8), {}), ((1, 1), {}),
        ((12, 1000), {"beta": 1.5}),
    ],
})
