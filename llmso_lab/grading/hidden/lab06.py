"""Hidden checks for Lab 06 (instructor only; not in the student bundle): other shapes, bits and groupings."""
import torch

from llmso_lab.grading.registry import hidden
from llmso_lab.grading.specs.lab06 import awq_layer, codes, int4_case, logits_case, randn, with_outliers

hidden("06", {
    "fake_quantize": [
        ((randn(16, 128, seed=101), 4), {"group_size": 64, "symmetric": True}),
        ((randn(7, 64, seed=102, scale=0.02), 4), {"group_size": 32, "symmetric": False}),   # SmolLM2-sized weights
        ((with_outliers(3, 96, 103, (1, 50)), 8), {"group_size": 32, "symmetric": False}),
        ((randn(10, 40, seed=104), 5), {"group_size": None, "symmetric": False}),
        ((randn(2, 256, seed=105), 3), {"group_size": 128, "symmetric": True}),
        ((randn(4, 8, seed=106) + 5.0, 4), {"group_size": None, "symmetric": False}),         # all positive
    ],
    "pack_int4": [
        ((codes(1, 2, seed=110),), {}),
        ((codes(32, 64, seed=111),), {}),
        ((codes(5, 4, 2, seed=112),), {}),
        ((codes(3, 100, seed=113),), {}),
    ],
    "int4_matmul": [
        (int4_case(2, 4, 32, 8, seed=160), {}),                 # small groups
        (int4_case(7, 16, 96, 32, seed=161), {}),               # 3 groups per row
        (int4_case(1, 64, 576, 64, seed=162), {}),              # SmolLM2's hidden 576, one decode row
        (int4_case(4, 10, 64, 32, seed=163, outlier=40), {}),   # an outlier in the second group
    ],
    "smoothquant_scales": [
        ((with_outliers(128, 48, 120, (2, 9, 33)).abs().amax(0), [randn(48, 48, seed=121)] * 2, 0.5), {}),
        ((randn(16, 20, seed=122).abs().amax(0), randn(30, 20, seed=123, scale=0.01), 0.9), {}),
        ((randn(16, 20, seed=124).abs().amax(0) * 50, [randn(5, 20, seed=125), randn(7, 20, seed=126)], 0.25), {}),
        ((torch.tensor([0.0, 0.0, 3.0, 1e-7]), randn(2, 4, seed=127), 0.6), {}),
        ((with_outliers(32, 12, 128, (4,)).abs().amax(0), randn(6, 12, seed=129), 1.0), {}),
    ],
    "awq_scale_search": [
        (awq_layer(24, 96, 64, 130, (3, 50, 90)), {"bits": 4, "group_size": 32, "grid": 20}),
        (awq_layer(8, 32, 32, 132, (31,)), {"bits": 2, "group_size": 16, "grid": 12}),
        (awq_layer(20, 64, 50, 134, (10, 11)), {"bits": 4, "group_size": 64, "grid": 5}),
        (awq_layer(10, 40, 30, 136, (0,)), {"bits": 3, "group_size": None, "grid": 16}),
    ],
    "mask_2_4": [
        ((randn(9, 32, seed=140),), {}),
        ((randn(1, 4, seed=141),), {}),
        ((torch.zeros(2, 8),), {}),                                    # all ties: positions 0 and 1 of each group
        ((randn(3, 12, seed=142) * (torch.arange(12) % 4 == 3),), {}),  # one nonzero per group
    ],
    "distillation_loss": [
        (logits_case(16, 50, 150), {"T": 2.0, "alpha": 0.9}),
        (logits_case(3, 7, 151, scale=10.0), {"T": 0.5, "alpha": 0.5}),
        (logits_case(9, 32, 152), {"T": 8.0, "alpha": 1.0}),
        (tuple(t.reshape(3, 3, *t.shape[1:]) for t in logits_case(9, 6, 153)), {"T": 2.0, "alpha": 0.0}),
    ],
})
