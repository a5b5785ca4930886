"""Round-to-nearest (RTN) weight quantization: scales per tensor, per output channel or per group, symmetric or
asymmetric, 2..8 bits, stored really packed (two int4 codes per byte).

A weight matrix W [out, in] is cut along `in` into groups of `group_size` numbers (per channel: one group per
row; per tensor: one group for everything). Each group gets its own grid of 2^bits levels:

- symmetric:  w ~ scale * q,            q in [-2^(b-1), 2^(b-1) - 1],  scale = max|w| / (2^(b-1) - 1)
- asymmetric: w ~ scale * q + minimum,  q in [0, 2^b - 1],             scale = (max w - min w) / (2^b - 1)

The asymmetric form with a float minimum is GGUF's Q4_1 block (and the "float zero" that tinygemm's int4
kernel takes); the symmetric one is what int8 weight-only kernels use. Codes are packed into a little-endian
bit stream: code i occupies bits [i*b, (i+1)*b), so for 4 bits byte j = q[2j] | q[2j+1] << 4.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["QuantizedTensor", "quantize", "dequantize", "fake_quantize", "pack_bits", "unpack_bits", "QuantLinear",
           "quantize_linears", "grid_params", "grid_codes", "grid_values", "pack_int4", "unpack_int4", "int4_matmul"]


@dataclass(slots=True)
class QuantizedTensor:
    """A weight [out, in] as packed codes plus per-group scales (and minimums when asymmetric)."""
    packed: Tensor           # uint8 [out, in * bits / 8]: unsigned codes (symmetric ones offset by 2^(b-1))
    scale: Tensor            # fp32 [out, in / group_size] (per tensor: [1, 1])
    minimum: Tensor | None   # fp32, same shape as scale; None = symmetric
    bits: int
    group_size: int          # numbers per group along `in` (per channel: in; per tensor: out * in)
    shape: tuple[int, int]

    @property
    def symmetric(self) -> bool:
        return self.minimum is None

    def codes(self) -> Tensor:
        """Signed (symmetric) or unsigned (asymmetric) integer codes, int16 [out, in]."""
        q = unpack_bits(self.packed, self.bits, self.shape[1]).to(torch.int16)
        return q - (1 << (self.bits - 1)) if self.symmetric else q

    def dequantize(self) -> Tensor:
        return dequantize(self)

    @property
    def nbytes(self) -> int:
        """Bytes stored: packed codes + scales (+ minimums), as fp16 the way GGUF and GPU kernels keep them."""
        return self.packed.numel() + 2 * self.scale.numel() * (1 if self.symmetric else 2)


def _check(w: Tensor, bits: int) -> None:
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in 2..8, got {bits}")


def _groups(w: Tensor, group_size: int | None, per_tensor: bool) -> tuple[Tensor, int]:
    """View W [out, in] as [out, n_groups, g] (per tensor: [1, 1, out * in])."""
    out_f, in_f = w.shape
    if per_tensor:
        return w.reshape(1, 1, -1), out_f * in_f
    g = in_f if group_size is None else group_size
    if g <= 0 or in_f % g:
        raise ValueError(f"group_size={group_size} does not divide the {in_f} input features; pick a divisor "
                         f"(e.g. 32 or 64 for SmolLM2, whose 576 and 1536 are not multiples of 128) or None for per channel")
    return w.reshape(out_f, in_f // g, g), g


def quantize(w: Tensor, bits: int = 4, *, group_size: int | None = None, per_tensor: bool = False,
             symmetric: bool = True) -> QuantizedTensor:
    """RTN-quantize a weight [out, in]. `group_size=None`: one scale per output channel (row);
    `per_tensor=True`: one scale for the whole matrix."""
    _check(w, bits)
    x, g = _groups(w.detach().float(), group_size, per_tensor)
    scale, minimum = grid_params(x, bits, symmetric)                                   # [out, G]
    q = grid_codes(x, scale, minimum, bits)
    codes = (q if minimum is not None else q + (1 << (bits - 1))).to(torch.uint8).reshape(w.shape)
    return QuantizedTensor(pack_bits(codes, bits), scale, minimum, bits, g, tuple(w.shape))


def grid_params(x: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, Tensor | None]:
    """The grid of the numbers along x's last dimension (one group): `(scale, minimum)`, each of shape
    x.shape[:-1]; minimum is None when symmetric. The one home of the grid formula (RTN, AWQ, GPTQ use it)."""
    if symmetric:
        return (x.abs().amax(-1) / ((1 << (bits - 1)) - 1)).clamp_min(1e-12), None
    lo, hi = x.amin(-1), x.amax(-1)
    return ((hi - lo) / ((1 << bits) - 1)).clamp_min(1e-12), lo


def grid_codes(x: Tensor, scale: Tensor, minimum: Tensor | None, bits: int) -> Tensor:
    """Round x [..., g] to the nearest level of the grid (scale, minimum: shape x.shape[:-1]): integer-valued
    float codes, signed in [-2^(b-1), 2^(b-1) - 1] when symmetric (minimum None), else in [0, 2^b - 1]."""
    if minimum is None:
        qmax = (1 << (bits - 1)) - 1
        return torch.clamp(torch.round(x / scale[..., None]), -qmax - 1, qmax)
    return torch.clamp(torch.round((x - minimum[..., None]) / scale[..., None]), 0, (1 << bits) - 1)


def grid_values(q: Tensor, scale: Tensor, minimum: Tensor | None) -> Tensor:
    """The numbers codes q [..., g] stand for: scale * q (+ minimum). `dequantize` computes exactly this."""
    w = q * scale[..., None]
    return w if minimum is None else w + minimum[..., None]


def dequantize(qt: QuantizedTensor) -> Tensor:
    """fp32 [out, in]: scale * q (+ minimum), group by group."""
    out_f, in_f = qt.shape
    q = qt.codes().float()
    q = q.reshape(1, 1, -1) if qt.scale.numel() == 1 and qt.group_size == out_f * in_f else q.reshape(out_f, -1, qt.group_size)
    return grid_values(q, qt.scale, qt.minimum).reshape(out_f, in_f)


def fake_quantize(w: Tensor, bits: int = 4, *, group_size: int | None = None, per_tensor: bool = False,
                  symmetric: bool = True) -> Tensor:
    """quantize then dequantize, in w's dtype: what the model computes with after weight-only quantization.
    The same numbers as `dequantize(quantize(w, ...))`, without packing codes (AWQ's search calls it often)."""
    _check(w, bits)
    x, _ = _groups(w.detach().float(), group_size, per_tensor)
    scale, minimum = grid_params(x, bits, symmetric)
    return grid_values(grid_codes(x, scale, minimum, bits), scale, minimum).reshape(w.shape).to(w.dtype)


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Unsigned codes uint8 [..., n] (each < 2^bits) -> uint8 [..., n * bits / 8], a little-endian bit stream."""
    n = codes.shape[-1]
    if (n * bits) % 8:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole bytes; pad the last dimension")
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"a code is >= 2^{bits}: codes must be unsigned and fit in {bits} bits")
    if 8 % bits == 0:   # whole codes per byte (1, 2, 4, 8 bits): code k of a byte sits at bit k * bits
        per = 8 // bits     # same stream as the bit-by-bit path below, which is slow on 100M weights
        c = codes.to(torch.uint8).reshape(*codes.shape[:-1], n // per, per)
        packed = c[..., 0].clone()
        for k in range(1, per):
            packed |= c[..., k] << (k * bits)
        return packed
    shifts = torch.arange(bits, dtype=torch.uint8, device=codes.device)
    stream = (codes.to(torch.uint8)[..., None] >> shifts) & 1                  # [..., n, bits] bits, LSB first
    stream = stream.reshape(*codes.shape[:-1], -1, 8)                           # [..., bytes, 8]
    weights = (1 << torch.arange(8, dtype=torch.int32, device=codes.device))
    return (stream.to(torch.int32) * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of `pack_bits`: uint8 [..., n * bits / 8] -> uint8 codes [..., n]."""
    if 8 % bits == 0:
        per = 8 // bits
        assert packed.shape[-1] * per == n, f"packed data holds {packed.shape[-1] * per} codes, expected {n}"
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*packed.shape[:-1], n)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed[..., None] >> shifts) & 1).reshape(*packed.shape[:-1], -1, bits)   # [..., n, bits]
    weights = (1 << torch.arange(bits, dtype=torch.int32, device=packed.device))
    codes = (stream.to(torch.int32) * weights).sum(-1).to(torch.uint8)
    assert codes.shape[-1] == n, f"packed data holds {codes.shape[-1]} codes, expected {n}"
    return codes


def pack_int4(codes: Tensor) -> Tensor:
    """uint8 codes 0..15 [..., n] -> uint8 [..., n / 2]: two per byte, the even index in the low nibble."""
    return pack_bits(codes, 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of `pack_int4`: uint8 [..., m] -> codes [..., 2 m]."""
    return unpack_bits(packed, 4, 2 * packed.shape[-1])


def int4_matmul(x: Tensor, packed: Tensor, scale: Tensor, minimum: Tensor, group_size: int) -> Tensor:
    """W4A16 by unpacking: x [N, in] times the asymmetric int4 weight stored as `packed` uint8 [out, in / 2] (two codes
    per byte, the even input index in the low nibble, `pack_int4`'s layout) with per-group `scale`, `minimum`
    [out, in / group_size]: w[o, i] = scale[o, g] * code[o, i] + minimum[o, g], g = i // group_size -> y [N, out].
    Forms the fp32 weight once (a reference; a real kernel unpacks tile by tile and never writes W back)."""
    out_f, half = packed.shape
    if packed.dtype != torch.uint8 or x.shape[-1] != 2 * half or (2 * half) % group_size:
        raise ValueError(f"x [N, {x.shape[-1]}] needs packed uint8 [out, in / 2] with in divisible by group_size "
                         f"{group_size}; got packed {packed.dtype} {list(packed.shape)}")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(out_f, -1, group_size).float()  # [out, groups, g]
    w = (codes * scale[..., None] + minimum[..., None]).reshape(out_f, 2 * half)
    return x.float() @ w.T


class QuantLinear(torch.nn.Module):
    """A Linear whose weight lives packed (`QuantizedTensor`); forward dequantizes, then multiplies in x's dtype.
    The reference for every faster weight-only kernel: same numbers, no speed."""

    def __init__(self, qweight: QuantizedTensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.qweight, self.bias = qweight, bias
        self.out_features, self.in_features = qweight.shape

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, self.qweight.dequantize().to(x.dtype),
                                          None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        q = self.qweight
        kind = "per-tensor" if q.group_size == q.shape[0] * q.shape[1] else (
            "per-channel" if q.group_size == q.shape[1] else f"group {q.group_size}")
        return f"{self.in_features} -> {self.out_features}, int{q.bits} {kind}, {'sym' if q.symmetric else 'asym'}"


def quantize_linears(model: torch.nn.Module, bits: int = 4, *, skip: tuple[str, ...] = ("lm_head",), **kw) -> dict[str, QuantizedTensor]:
    """Replace every nn.Linear of `model` (in place) by a `QuantLinear`, except names ending in `skip`.
    Returns {name: QuantizedTensor}. A tied LM head shares the embedding: quantizing it would quantize the
    embedding too, so it is skipped by default."""
    done: dict[str, QuantizedTensor] = {}
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, torch.nn.Linear) and not full.endswith(skip):
                qt = quantize(child.weight, bits, **kw)
                setattr(mod, child_name, QuantLinear(qt, child.bias))
                done[full] = qt
    return done
