"""Quantization and compression (lecture 1-3): RTN weight quantization with packing, weight-only kernels for the
engine, W8A8 / SmoothQuant / FP8, AWQ, GPTQ, the GGUF checkpoint's own Q4_1 blocks, pruning, distillation."""
from llmso_lab.quant.awq import (AWQResult, awq_fake_quantize, awq_quantize_model, awq_scales, awq_search,
                                 output_error)
from llmso_lab.quant.calibration import channel_mean_abs, collect_linear_inputs, input_hessian, linear_names
from llmso_lab.quant.gptq import GPTQResult, gptq_hessian, gptq_quantize, gptq_quantize_model, gptq_quantize_packed
from llmso_lab.quant.rtn import (QuantizedTensor, QuantLinear, dequantize, fake_quantize, grid_codes, grid_params,
                                 grid_values, pack_bits, quantize, quantize_linears, unpack_bits)

__all__ = ["QuantizedTensor", "QuantLinear", "quantize", "dequantize", "fake_quantize", "pack_bits", "unpack_bits",
           "quantize_linears", "grid_params", "grid_codes", "grid_values",
           "linear_names", "collect_linear_inputs", "channel_mean_abs", "input_hessian",
           "AWQResult", "awq_scales", "awq_fake_quantize", "awq_search", "awq_quantize_model", "output_error",
           "GPTQResult", "gptq_hessian", "gptq_quantize", "gptq_quantize_packed", "gptq_quantize_model"]
