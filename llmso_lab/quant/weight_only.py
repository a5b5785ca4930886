"""Weight-only quantized matmuls (W8A16, W4A16) that read packed weights directly: what makes decode faster.

Batch-1 decode reads every weight once per token and does 2 FLOPs per weight read (Lab 00): it is bound by
memory bandwidth, so a weight stored in 1 byte (int8) or half a byte (int4) instead of 4 (fp32) is read 4x or 8x
faster — if the kernel multiplies straight from the packed bytes. Dequantizing to a float matrix first would
write and re-read the full-size matrix and lose the gain.

On CPU we call the kernels PyTorch ships for this (the ones gpt-fast uses):
- int8: `torch._weight_int8pack_mm(x_bf16, w_int8 [out, in], scale [out])`, symmetric per output channel;
- int4: `torch._weight_int4pack_mm_for_cpu(x_bf16, packed, group_size, scale_and_zero [in/g, out, 2])`, asymmetric
  per group ("tinygemm": w = (q - 8) * scale + zero, i.e. zero = minimum + 8 * scale).
Both want bf16 activations (fp32 activations take a slow path); the engine keeps norms, softmax and the
residual stream in fp32 and casts only the matmul inputs. On CUDA the int4 path is our Triton kernel
(`llmso_lab.quant.triton_w4a16`): int4 unpacking and group scales inside the matmul tile.
"""
from __future__ import annotations

import torch
from torch import Tensor

from llmso_lab.quant.rtn import QuantizedTensor, quantize, unpack_bits

__all__ = ["WeightOnlyInt8", "WeightOnlyInt4", "quantize_weight", "QUANTIZATION_METHODS", "WeightOnlyLinear",
           "quantize_model_weight_only", "dequantized_copy"]

QUANTIZATION_METHODS = ("int8", "int4")


class WeightOnlyInt8:
    """W8A16: int8 weight, one fp scale per output channel; `self(x)` = x @ (scale * q)^T."""
    bits = 8

    def __init__(self, w: Tensor, bias: Tensor | None = None) -> None:
        self.qt = quantize(w, 8, symmetric=True)                                     # per output channel
        self.q = self.qt.codes().to(torch.int8).contiguous()                        # [out, in]
        self.scale = self.qt.scale.reshape(-1)                                      # [out] fp32
        self.bias = bias
        self.out_features, self.in_features = w.shape
        self.use_cuda = w.is_cuda
        self._scale_bf16 = self.scale.to(torch.bfloat16)

    def __call__(self, x: Tensor) -> Tensor:
        """x [T, in] (any float dtype) -> [T, out] in x's dtype."""
        if self.use_cuda:   # no int8 weight-only kernel of ours on GPU: dequantize on the fly (correct, not fast)
            y = x @ (self.q.to(x.dtype) * self.scale.to(x.dtype)[:, None]).t()
        else:
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self._scale_bf16).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def dequantize(self) -> Tensor:
        """The weight this kernel multiplies by, fp32 [out, in] (scales rounded to bf16 as the kernel uses them)."""
        return self.q.float() * self._scale_bf16.float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 2 * self.scale.numel()


class WeightOnlyInt4:
    """W4A16: int4 weight (two per byte), asymmetric, one scale and minimum per `group_size` inputs."""
    bits = 4

    def __init__(self, w: Tensor, bias: Tensor | None = None, group_size: int = 32, qt: QuantizedTensor | None = None) -> None:
        self.qt = qt if qt is not None else quantize(w, 4, group_size=group_size, symmetric=False)
        assert self.qt.bits == 4 and not self.qt.symmetric, "WeightOnlyInt4 takes asymmetric int4 (scale and minimum)"
        self.group_size = self.qt.group_size
        self.out_features, self.in_features = self.qt.shape
        self.bias = bias
        self.use_cuda = w.is_cuda
        scale, minimum = self.qt.scale, self.qt.minimum                            # [out, in/g] each
        self._scale_zero = torch.stack([scale, minimum + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        if self.use_cuda:
            self.packed = self.qt.packed                                            # [out, in/2] for the Triton kernel
        else:   # tinygemm's own layout, made from the unsigned codes
            codes = unpack_bits(self.qt.packed, 4, self.in_features).to(torch.int32)
            self.packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)

    def __call__(self, x: Tensor) -> Tensor:
        if self.use_cuda:
            from llmso_lab.quant.triton_w4a16 import w4a16_matmul
            y = w4a16_matmul(x.to(torch.float16), self.qt.packed, self.qt.scale.half(), self.qt.minimum.half(),
                             self.group_size).to(x.dtype)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.packed, self.group_size,
                                                 self._scale_zero).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    @property
    def scales_and_zeros(self) -> Tensor:
        """The kernel's bf16 (scale, zero) per output and group, [out, in / group_size, 2] (a view): the weight is
        (q - 8) * scale + zero for the unsigned code q."""
        return self._scale_zero.transpose(0, 1)

    def dequantize(self) -> Tensor:
        """fp32 [out, in] with the kernel's bf16 scale and zero: (q - 8) * scale + zero."""
        sz = self.scales_and_zeros.float()                                          # [out, in/g, 2]
        q = unpack_bits(self.qt.packed, 4, self.in_features).float().reshape(self.out_features, -1, self.group_size)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.qt.nbytes


def quantize_weight(w: Tensor, method: str, bias: Tensor | None = None, group_size: int = 32):
    """An HF-layout weight [out, in] -> the callable weight-only matmul for `method` ("int8" | "int4")."""
    if method == "int8":
        return WeightOnlyInt8(w, bias)
    if method == "int4":
        return WeightOnlyInt4(w, bias, group_size=group_size)
    raise ValueError(f"quantization={method!r} is not supported; valid: {', '.join(QUANTIZATION_METHODS)} (or None)")


class WeightOnlyLinear(torch.nn.Module):
    """An nn.Linear replacement running a weight-only kernel, so a Hugging Face model can use it (perplexity)."""

    def __init__(self, linear: torch.nn.Linear, method: str, group_size: int = 32) -> None:
        super().__init__()
        self.kernel = quantize_weight(linear.weight.detach().float(), method, group_size=group_size)
        self.bias = linear.bias
        self.method, self.in_features, self.out_features = method, linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        y = self.kernel(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {type(self.kernel).__name__}"


def _linears(model: torch.nn.Module):
    """(parent module, attribute name, nn.Linear) for every Linear of `model`, the LM head included."""
    return [(mod, n, c) for mod in model.modules() for n, c in mod.named_children() if isinstance(c, torch.nn.Linear)]


def quantize_model_weight_only(model: torch.nn.Module, method: str, group_size: int = 32) -> torch.nn.Module:
    """Replace every Linear (LM head included, as the engine does) by a `WeightOnlyLinear`, in place. A tied LM
    head is untied first: the embedding lookup keeps its full-precision table."""
    for mod, name, lin in _linears(model):
        setattr(mod, name, WeightOnlyLinear(lin, method, group_size))
    return model


@torch.no_grad()
def dequantized_copy(model: torch.nn.Module, method: str, group_size: int = 32) -> torch.nn.Module:
    """A deep copy of an HF model whose Linear weights (LM head included, untied from the embedding) are exactly
    the weights the `method` kernel multiplies by, in fp32: the reference the quantized engine is tested against."""
    import copy
    ref = copy.deepcopy(model).float()
    for mod, name, lin in _linears(ref):
        lin.weight = torch.nn.Parameter(quantize_weight(lin.weight.float(), method, group_size=group_size).dequantize())
    return ref
