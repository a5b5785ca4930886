"""Quantization and compression (lecture 1-3): RTN weight quantization with packing, weight-only kernels for the
engine, W8A8 / SmoothQuant / FP8, AWQ, GPTQ, the GGUF checkpoint's own Q4_1 blocks, pruning, distillation."""
from llmso_lab.quant.rtn import (QuantizedTensor, QuantLinear, dequantize, fake_quantize, pack_bits, quantize,
                                 quantize_linears, unpack_bits, pack_int4, unpack_int4)

__all__ = ["QuantizedTensor", "QuantLinear", "quantize", "dequantize", "fake_quantize", "pack_bits", "unpack_bits",
           "quantize_linears",
           "pack_int4", "unpack_int4"]
