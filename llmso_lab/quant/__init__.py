"""Quantization and compression (lecture 1-3): RTN weight quantization with packing, weight-only kernels for the
engine, W8A8 / SmoothQuant / FP8, AWQ, GPTQ, the GGUF checkpoint's own Q4_1 blocks, pruning, distillation."""
from llmso_lab.quant.rtn import (QuantizedTensor, QuantLinear, dequantize, fake_quantize, pack_bits, quantize,
                                 quantize_linears, unpack_bits)
from llmso_lab.quant.rtn import grid_codes, grid_params, grid_values, pack_int4, unpack_int4
from llmso_lab.quant.w8a8 import (FP8_FORMATS, FP8Linear, W8A8Linear, activation_absmax, fp8_linear,
                                  fp8_representation_error, int8_mm, int8_mm_backend, outlier_stats,
                                  quantize_linears_w8a8, quantize_per_token, quantize_weight_int8, smooth_model,
                                  smoothquant_scales, to_fp8, w8a8_linear)
from llmso_lab.quant.awq import (AWQResult, awq_best_scales, awq_fake_quantize, awq_fold_for_engine,
                                 awq_quantize_model, awq_scales, awq_search, output_error)
from llmso_lab.quant.calibration import channel_mean_abs, collect_linear_inputs, input_hessian, linear_names
from llmso_lab.quant.gptq import GPTQResult, gptq_hessian, gptq_quantize, gptq_quantize_model, gptq_quantize_packed
from llmso_lab.quant.gguf import (compare_with_rtn, gguf_tensor_types, gguf_type_summary, q4_1_blocks,
                                  q4_1_dequantize, q4_1_pack, rope_row_permutation)

__all__ = ["QuantizedTensor", "QuantLinear", "quantize", "dequantize", "fake_quantize", "pack_bits", "unpack_bits",
           "quantize_linears",
           "grid_params", "grid_codes", "grid_values", "pack_int4", "unpack_int4",
           "quantize_per_token", "quantize_weight_int8", "int8_mm", "int8_mm_backend", "w8a8_linear", "W8A8Linear",
           "FP8_FORMATS", "to_fp8", "fp8_linear", "fp8_representation_error", "FP8Linear", "quantize_linears_w8a8",
           "activation_absmax", "smoothquant_scales", "smooth_model", "outlier_stats",
           "gguf_tensor_types", "gguf_type_summary", "q4_1_blocks", "q4_1_dequantize", "q4_1_pack",
           "rope_row_permutation", "compare_with_rtn",
           "linear_names", "collect_linear_inputs", "channel_mean_abs", "input_hessian",
           "AWQResult", "awq_scales", "awq_fake_quantize", "awq_search", "awq_quantize_model", "output_error",
           "awq_best_scales", "awq_fold_for_engine",
           "GPTQResult", "gptq_hessian", "gptq_quantize", "gptq_quantize_packed", "gptq_quantize_model"]
