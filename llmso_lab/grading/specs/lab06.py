"""Lab 06 (quantization and compression) exercises and their public checks.

References: `llmso_lab.quant.rtn:fake_quantize` (round-to-nearest on a per-channel or per-group grid),
`llmso_lab.quant.rtn:pack_int4` (two int4 codes per byte), `llmso_lab.quant.rtn:int4_matmul` (W4A16 by unpacking), `llmso_lab.quant.w8a8:smoothquant_scales`,
`llmso_lab.quant.awq:awq_best_scales` (AWQ's grid search for one linear), `llmso_lab.quant.prune:mask_2_4`,
`llmso_lab.quant.distill:distillation_loss`. Inputs are small and seeded, so the checks are the same everywhere.
"""
import torch

from llmso_lab.grading.compare import close, exact
from llmso_lab.grading.registry import Case, Exercise, register

fp32 = close(atol=1e-5, rtol=1e-5)      # torch in fp32: only rounding differences
loss_tol = close(atol=1e-5, rtol=1e-4)  # a scalar summed over a vocabulary: summation order
RTN_CODE = ("llmso_lab.quant.rtn:quantize", "llmso_lab.quant.rtn:dequantize", "llmso_lab.quant.rtn:grid_params",
            "llmso_lab.quant.rtn:grid_codes", "llmso_lab.quant.rtn:grid_values",
            "llmso_lab.quant.rtn:quantize_linears", "llmso_lab.quant.rtn:QuantizedTensor.dequantize",
            "llmso_lab.quant.awq:awq_fake_quantize", "llmso_lab.quant.w8a8:quantize_weight_int8",
            "llmso_lab.quant.w8a8:quantize_per_token", "llmso_lab.quant.weight_only:quantize_weight")


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def codes(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 16, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def with_outliers(rows: int, cols: int, seed: int, channels: tuple[int, ...], size: float = 12.0) -> torch.Tensor:
    """randn [rows, cols] whose given columns are `size` times larger (activation outlier channels)."""
    x = randn(rows, cols, seed=seed)
    x[:, list(channels)] *= size
    return x


def awq_layer(out_f: int, in_f: int, n: int, seed: int, channels: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] and calibration inputs [n, in] with a few salient (large-activation) input channels."""
    return randn(out_f, in_f, seed=seed, scale=0.1), with_outliers(n, in_f, seed + 1, channels, size=20.0)


UNPACK_CODE = ("llmso_lab.quant.rtn:unpack_bits", "llmso_lab.quant.rtn:unpack_int4", "llmso_lab.quant.rtn:QuantizedTensor.codes",
               "llmso_lab.quant.rtn:QuantLinear.forward", "llmso_lab.quant.weight_only:WeightOnlyInt4.dequantize",
               "llmso_lab.quant.gguf:q4_1_blocks", "llmso_lab.quant.gguf:q4_1_dequantize")


def int4_case(n: int, out_f: int, in_f: int, group: int, seed: int, outlier: int | None = None):
    """(x [n, in], packed uint8 [out, in / 2], scale, minimum [out, in / group], group): an asymmetric int4 weight in
    `pack_int4`'s layout, quantized by the library's RTN (built here, in the grader, never in the student's process)."""
    from llmso_lab.quant.rtn import quantize

    w = randn(out_f, in_f, seed=seed, scale=0.1)
    if outlier is not None:
        w[:, outlier] *= 15.0
    qt = quantize(w, 4, group_size=group, symmetric=False)
    return randn(n, in_f, seed=seed + 1), qt.packed, qt.scale, qt.minimum, group


def logits_case(n: int, v: int, seed: int, scale: float = 3.0):
    """student logits [n, v], teacher logits [n, v] (correlated with the student's), labels [n]."""
    s = randn(n, v, seed=seed, scale=scale)
    t = 0.6 * s + randn(n, v, seed=seed + 1, scale=scale)
    labels = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed + 2))
    return s, t, labels


def two_four_ties() -> torch.Tensor:
    """Groups with equal magnitudes: the earlier position must win."""
    return torch.tensor([[1.0, -1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0],
                         [0.2, 0.3, -0.3, 0.3, 2.0, -2.0, 2.0, -2.0]])


register(
    Exercise("fake_quantize", "06", 20, "llmso_lab.quant.rtn:fake_quantize", [
        Case("int4 symmetric, one scale per output channel (row)", (randn(8, 64, seed=1), 4),
             {"group_size": None, "symmetric": True}),
        Case("int4 asymmetric, groups of 32 (GGUF's Q4_1 grid)", (randn(6, 96, seed=2), 4),
             {"group_size": 32, "symmetric": False}),
        Case("int8 symmetric per channel", (randn(5, 48, seed=3), 8), {"group_size": None, "symmetric": True}),
        Case("int3 asymmetric, groups of 16, an outlier column", (with_outliers(4, 64, 4, (5,)), 3),
             {"group_size": 16, "symmetric": False}),
        Case("int2 symmetric, groups of 8", (randn(3, 32, seed=5), 2), {"group_size": 8, "symmetric": True}),
    ], compare=fp32, tripwires=RTN_CODE,
        description="round-to-nearest quantize then dequantize a weight [out, in] per channel or per group"),
    Exercise("pack_int4", "06", 5, "llmso_lab.quant.rtn:pack_int4", [
        Case("one row: [0x3, 0xA, 0xF, 0x1] -> [0xA3, 0x1F]", (torch.tensor([[3, 10, 15, 1]], dtype=torch.uint8),)),
        Case("codes [4, 16]", (codes(4, 16, seed=10),)),
        Case("codes [2, 3, 8] (any leading shape)", (codes(2, 3, 8, seed=11),)),
        Case("all 15s and all 0s", (torch.tensor([[15] * 6, [0] * 6], dtype=torch.uint8),)),
    ], compare=exact(), tripwires=("llmso_lab.quant.rtn:pack_bits", "llmso_lab.quant.rtn:unpack_bits",
                                   "llmso_lab.quant.rtn:unpack_int4", "llmso_lab.quant.gguf:q4_1_pack"),
        description="two 4-bit codes per uint8 byte, the even index in the low nibble"),
    Exercise("int4_matmul", "06", 15, "llmso_lab.quant.rtn:int4_matmul", [
        Case("x [3, 64] times a packed int4 weight [8, 64], groups of 32", int4_case(3, 8, 64, 32, seed=60)),
        Case("one decode row, groups of 16 (8 groups per row)", int4_case(1, 12, 128, 16, seed=61)),
        Case("a weight with an outlier column, groups of 64 = the whole row", int4_case(5, 6, 64, 64, seed=62, outlier=9)),
        Case("bigger: x [16, 256] (a prefill chunk), weight [48, 256], groups of 32", int4_case(16, 48, 256, 32, seed=63)),
    ], compare=close(atol=1e-4, rtol=1e-4), tripwires=RTN_CODE + UNPACK_CODE + ("llmso_lab.quant.triton_w4a16:w4a16_matmul",),
        description="W4A16 by hand: unpack two codes per byte, scale and minimum per group, multiply; equals the "
                    "dequantized weight's matmul"),
    Exercise("smoothquant_scales", "06", 10, "llmso_lab.quant.w8a8:smoothquant_scales", [
        Case("alpha 0.5, one weight [16, 32], outlier channels 3 and 17",
             (with_outliers(64, 32, 20, (3, 17)).abs().amax(0), randn(16, 32, seed=21), 0.5)),
        Case("alpha 0.75, q/k/v share the input: max |W_j| over all their rows",
             (with_outliers(64, 24, 22, (0,)).abs().amax(0), [randn(12, 24, seed=23), randn(4, 24, seed=24, scale=3.0),
                                                              randn(4, 24, seed=25)], 0.75)),
        Case("alpha 0: s_j = 1 / max |W_j|", (randn(32, 16, seed=26).abs().amax(0), randn(8, 16, seed=27), 0.0)),
        Case("a dead channel (max |X_j| = 0) stays finite: both maxima clamped at 1e-5",
             (torch.tensor([0.0, 1.0, 4.0, 0.5]), randn(3, 4, seed=28), 0.5)),
    ], compare=fp32, tripwires=("llmso_lab.quant.w8a8:smooth_model",),
        description="SmoothQuant's per-channel migration scales s_j = max|X_j|^a / max|W_j|^(1-a)"),
    Exercise("awq_scale_search", "06", 20, "llmso_lab.quant.awq:awq_best_scales", [
        Case("int4, groups of 32, 2 salient channels, grid of 10", awq_layer(16, 64, 48, 30, (7, 40)),
             {"bits": 4, "group_size": 32, "grid": 10}),
        Case("int3 per channel, 3 salient channels, grid of 20", awq_layer(12, 48, 40, 32, (0, 1, 30)),
             {"bits": 3, "group_size": None, "grid": 20}),
        Case("int4, groups of 16, no salient channel (alpha 0, plain RTN, may win)", (randn(8, 32, seed=34, scale=0.1),
                                                                                    randn(40, 32, seed=35)),
             {"bits": 4, "group_size": 16, "grid": 8}),
        Case("int3 per channel, no salient channel, grid of 10: alpha 0 wins by 3%", (randn(12, 48, seed=336, scale=0.1),
                                                                                     randn(36, 48, seed=337)),
             {"bits": 3, "group_size": None, "grid": 10}, hidden=True),
    ], compare=fp32, tripwires=("llmso_lab.quant.awq:awq_search", "llmso_lab.quant.awq:awq_scales",
                                "llmso_lab.quant.awq:awq_quantize_model", "llmso_lab.quant.awq:awq_fold_for_engine"),
        description="AWQ: the per-input-channel scales s = s_x^alpha (normalised) with the least output error"),
    Exercise("mask_2_4", "06", 15, "llmso_lab.quant.prune:mask_2_4", [
        Case("a weight [4, 16]", (randn(4, 16, seed=40),)),
        Case("signs matter not, magnitudes do", (randn(6, 8, seed=41) * torch.tensor([1.0, -3.0] * 4),)),
        Case("ties: the earlier position wins", (two_four_ties(),)),
    ], compare=exact(), tripwires=("llmso_lab.quant.prune:prune_2_4", "llmso_lab.quant.prune:magnitude_mask",
                                   "llmso_lab.quant.prune:is_2_4"),
        description="2:4 semi-structured mask: the 2 largest |w| of every 4 consecutive input weights"),
    Exercise("distillation_loss", "06", 15, "llmso_lab.quant.distill:distillation_loss", [
        Case("T = 2, alpha = 0.5, 5 positions, vocabulary 11", logits_case(5, 11, 50), {"T": 2.0, "alpha": 0.5}),
        Case("soft labels only (alpha = 1), T = 4: the T^2 factor matters", logits_case(7, 13, 51), {"T": 4.0, "alpha": 1.0}),
        Case("hard labels only (alpha = 0): plain cross-entropy", logits_case(6, 9, 52), {"T": 3.0, "alpha": 0.0}),
        Case("T = 1, alpha = 0.3, 3-D logits [2, 4, 10]", tuple(t.reshape(2, 4, *t.shape[1:]) for t in logits_case(8, 10, 53)),
             {"T": 1.0, "alpha": 0.3}),
    ], compare=loss_tol, tripwires=("llmso_lab.quant.distill:train_student", "llmso_lab.quant.distill:topk_distillation_loss"),
        description="alpha T^2 KL(teacher_T || student_T) + (1 - alpha) CE(student, labels), mean over positions"),
)
