"""W8A8: int8 (or FP8) weights AND activations, so that prefill's compute-bound matmuls run on int8 / FP8
tensor cores; SmoothQuant to tame activation outlier channels (lecture 1-3).

- int8: weights per output channel (`rtn.quantize`, 8 bits, symmetric), activations per token (one scale per
  row of x, same grid). y[t, o] = sx[t] * sw[o] * sum_i qx[t, i] qw[o, i]: the sum is an int8 x int8 -> int32
  GEMM (`torch._int_mm`), then one rescale by the outer product of the two scale vectors.
- SmoothQuant (Xiao et al., 2023): activations have a few channels much larger than the rest, weights do not.
  X W^T = (X diag(s)^-1) (W diag(s))^T for any s > 0, so divide activation channel j by
  s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) and multiply weight column j by it: alpha moves the difficulty
  from activations (alpha = 1: activations flat) to weights (alpha = 0). In a Llama, X is an RMSNorm output,
  so 1/s folds into the norm's weight and costs nothing at run time.
- FP8: e4m3 (4 exponent bits, 3 mantissa: max 448, finer steps, inference) and e5m2 (5 and 2: max 57344, wider
  range, for gradients), with a scale = absmax / finfo.max per tensor, channel or token. Simulated on CPU
  (cast to FP8 and back, fp32 matmul); `torch._scaled_mm` is the real FP8 GEMM on Hopper-class GPUs.

Measured on SmolLM2-135M (fp32 model; perplexity on the whole eval text, 8,832 tokens, windows of 512;
calibration on `calib_text.txt`; lm_head kept in fp32; torch 2.13 CPU, `torch._int_mm`):
fp32 16.657. W8A8 int8 (per-channel weights, per-token activations): no smoothing 17.101; SmoothQuant
alpha = 0 / 0.25 / 0.5 / 0.75 / 1.0: 17.706 / 16.972 / 16.781 / 16.821 / 16.918 (alpha = 0 in the formula is
not "no smoothing": s = 1 / max|W_j| flattens the weights and loads everything onto the activations).
Outliers (per-channel max|x| over the calibration text, max / median): q_proj inputs 12x (median over layers;
worst 25x), gate_proj inputs 6x (worst 47x, layer 29), o_proj inputs 3x; down_proj inputs hold the "massive
activations": 10x typically, 2,211x in layer 11 (one channel at 2,973). SmoothQuant cannot fold into down_proj;
keeping it in fp32 gives 16.992 without smoothing and 16.722 with alpha = 0.5. FP8 (per-tensor weights,
per-token activations): e4m3 16.881, e5m2 18.654; e4m3 with per-channel weights 17.079 (the weight error is
the same, 2.63% vs 2.65%: a float format's relative error does not depend on the scale, so the gap is where
the roundings happen to fall), e4m3 after smoothing (alpha 0.5) 17.111: smoothing buys FP8 nothing.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from llmso_lab.quant.rtn import grid_codes, grid_params, quantize

__all__ = ["quantize_per_token", "quantize_weight_int8", "int8_mm", "int8_mm_backend", "w8a8_linear", "W8A8Linear",
           "FP8_FORMATS", "to_fp8", "fp8_linear", "fp8_representation_error", "FP8Linear", "quantize_linears_w8a8",
           "activation_absmax", "smoothquant_scales", "smooth_model", "outlier_stats"]


# ----------------------------------------------------------------------------------------------- int8 W8A8

def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., in] -> (q int8 [..., in], scale fp32 [..., 1]): symmetric, one scale per row (token),
    scale = max|row| / 127 — the grid of `rtn.quantize(bits=8, symmetric=True)` per channel, unpacked."""
    scale, _ = grid_params(x.float(), 8, symmetric=True)
    q = grid_codes(x.float(), scale, None, 8)
    return q.to(torch.int8), scale[..., None]


def quantize_weight_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """W [out, in] -> (q int8 [out, in], scale fp32 [out, 1]): `rtn.quantize` with 8 bits, symmetric, per channel."""
    qt = quantize(w, 8, group_size=None, symmetric=True)
    return qt.codes().to(torch.int8), qt.scale


def int8_mm_backend(a: Tensor, b: Tensor) -> str:
    """Which int8 GEMM `int8_mm(a, b)` runs: "torch._int_mm" (a real int8 GEMM; on CPU in torch 2.13 any 2-D
    int8 shapes; on CUDA it needs m > 16 and k, n multiples of 8) or the exact fallback."""
    m, k = a.shape
    n = b.shape[1]
    if not hasattr(torch, "_int_mm"):
        return "fallback"
    if a.is_cuda and not (m > 16 and k % 8 == 0 and n % 8 == 0):
        return "fallback"
    return "torch._int_mm"


def int8_mm(a: Tensor, b: Tensor) -> Tensor:
    """a int8 [m, k] @ b int8 [k, n] -> int32 [m, n], exact. Fallback: an int32 matmul on CPU, a float64 one on
    GPU (exact too: every partial sum is an integer far below 2^53)."""
    assert a.dtype == b.dtype == torch.int8 and a.dim() == b.dim() == 2, (a.dtype, b.dtype, a.shape, b.shape)
    if int8_mm_backend(a, b) == "torch._int_mm":
        return torch._int_mm(a, b)
    if a.is_cuda:
        return (a.double() @ b.double()).to(torch.int32)
    return a.to(torch.int32) @ b.to(torch.int32)


def w8a8_linear(x: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x W^T with x quantized per token on the fly and W given as int8 codes [out, in] + scales [out, 1].
    x [..., in] -> y [..., out] in x's dtype."""
    shape = x.shape
    xq, xs = quantize_per_token(x.reshape(-1, shape[-1]))          # [T, in] int8, [T, 1]
    acc = int8_mm(xq, w_q.t())                                      # [T, out] int32
    y = acc.float() * (xs * w_scale.reshape(1, -1))                 # outer product of the scales
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*shape[:-1], -1).to(x.dtype)


class W8A8Linear(torch.nn.Module):
    """Replaces an nn.Linear: int8 weights per channel, int8 activations per token (dynamic), int32 accumulate."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w_q, w_scale = quantize_weight_int8(linear.weight)
        self.register_buffer("w_q", w_q)
        self.register_buffer("w_scale", w_scale)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: Tensor) -> Tensor:
        return w8a8_linear(x, self.w_q, self.w_scale, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, int8 weights per channel, int8 activations per token"


# ----------------------------------------------------------------------------------------------- FP8

FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def to_fp8(x: Tensor, fmt: str = "e4m3", per: str = "tensor") -> tuple[Tensor, Tensor]:
    """x -> (x_fp8, scale) with x ~ x_fp8.float() * scale and scale = absmax / finfo(fmt).max, so the largest
    value lands on the format's largest number. `per`: "tensor" (one scale, shape [1, ..., 1]); "channel" (a
    weight [out, in]: one per output row) or "token" (activations [..., in]: one per row) — both take the
    absmax over the last dimension, scale [..., 1]."""
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fmt must be one of {list(FP8_FORMATS)}, got {fmt!r}")
    dtype = FP8_FORMATS[fmt]
    fmax = torch.finfo(dtype).max
    x = x.float()
    if per == "tensor":
        amax = x.abs().amax().reshape([1] * x.dim())
    elif per in ("channel", "token"):
        amax = x.abs().amax(-1, keepdim=True)
    else:
        raise ValueError(f"per must be 'tensor', 'channel' or 'token', got {per!r}")
    scale = (amax / fmax).clamp_min(1e-12)
    # clamp: x / scale can exceed fmax by a rounding error, and e4m3fn has no infinity to overflow into
    return (x / scale).clamp(-fmax, fmax).to(dtype), scale


def fp8_linear(x: Tensor, w_fp8: Tensor, w_scale: Tensor, bias: Tensor | None = None, *, fmt: str = "e4m3",
               use_scaled_mm: bool = False) -> Tensor:
    """y = x W^T with x cast to FP8 per token on the fly and W given as FP8 [out, in] + scale ([1, 1] or [out, 1]).
    Simulated: both FP8 tensors are cast back to fp32 and multiplied in fp32 (exact products: an FP8 number has
    at most 4 significant bits). `use_scaled_mm=True`: `torch._scaled_mm`, the fused FP8 GEMM (on CPU in
    torch 2.13 a reference implementation, on H100-class GPUs FP8 tensor cores)."""
    shape = x.shape
    xf, xs = to_fp8(x.reshape(-1, shape[-1]), fmt, per="token")          # [T, in], [T, 1]
    ws = w_scale.reshape(1, -1).float()                                   # [1, 1] or [1, out]
    if use_scaled_mm:
        y = torch._scaled_mm(xf, w_fp8.t(), scale_a=xs, scale_b=ws.expand(1, w_fp8.shape[0]).contiguous(),
                             out_dtype=torch.float32)
    else:
        y = (xf.float() @ w_fp8.float().t()) * (xs * ws)
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*shape[:-1], -1).to(x.dtype)


def fp8_representation_error(x: Tensor, per: str = "tensor") -> dict[str, dict[str, float]]:
    """How well e4m3 and e5m2 represent x (scaled as `to_fp8`). For each format: `rel_norm` = ||x8 - x|| / ||x||
    (dominated by the large values: e4m3's extra mantissa bit wins), `rel_elem` = mean over nonzero x of
    |x8 - x| / |x| and `underflow` = fraction of nonzero x that became 0 (values spanning many decades, like
    gradients: e5m2's range wins)."""
    x = x.float()
    nz = x != 0
    out = {}
    for fmt in FP8_FORMATS:
        x8, scale = to_fp8(x, fmt, per)
        back = x8.float() * scale
        out[fmt] = {"rel_norm": ((back - x).norm() / x.norm().clamp_min(1e-30)).item(),
                    "rel_elem": ((back - x).abs()[nz] / x.abs()[nz]).mean().item(),
                    "underflow": ((back == 0) & nz).sum().item() / max(int(nz.sum()), 1)}
    return out


class FP8Linear(torch.nn.Module):
    """Replaces an nn.Linear: FP8 weights (one scale per tensor by default) and FP8 activations per token."""

    def __init__(self, linear: torch.nn.Linear, fmt: str = "e4m3", weight_per: str = "tensor") -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt, self.weight_per = (linear.in_features, linear.out_features,
                                                                          fmt, weight_per)
        w8, w_scale = to_fp8(linear.weight.detach(), fmt, per=weight_per)
        self.register_buffer("w_fp8", w8)
        self.register_buffer("w_scale", w_scale)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.w_fp8, self.w_scale, self.bias, fmt=self.fmt)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt} weights per {self.weight_per}, per-token activations"


def quantize_linears_w8a8(model: torch.nn.Module, fmt: str = "int8", *, skip: tuple[str, ...] = ("lm_head",),
                          weight_per: str = "tensor") -> list[str]:
    """Replace every nn.Linear of `model` (in place) by a `W8A8Linear` (fmt="int8") or an `FP8Linear`
    (fmt="e4m3" / "e5m2", weights per `weight_per`), except names ending in `skip` (the tied LM head).
    Returns the names replaced."""
    if fmt != "int8" and fmt not in FP8_FORMATS:
        raise ValueError(f"fmt must be 'int8', 'e4m3' or 'e5m2', got {fmt!r}")
    done = []
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, torch.nn.Linear) and not full.endswith(skip):
                new = W8A8Linear(child) if fmt == "int8" else FP8Linear(child, fmt, weight_per)
                setattr(mod, child_name, new)
                done.append(full)
    return done


# ----------------------------------------------------------------------------------------------- SmoothQuant

@torch.no_grad()
def activation_absmax(model: torch.nn.Module, token_ids: Sequence[int], window: int = 512,
                      names: Sequence[str] | None = None) -> dict[str, Tensor]:
    """Per-input-channel max |x| seen by each nn.Linear (or those in `names`) while the model reads `token_ids`
    in windows of `window` tokens: {name: fp32 [in_features]}."""
    stats: dict[str, Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and (names is None or name in names):
            def hook(_m, args, _out, name=name):
                a = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
                stats[name] = a if name not in stats else torch.maximum(stats[name], a)
            hooks.append(mod.register_forward_hook(hook))
    device = model.get_input_embeddings().weight.device
    try:
        for start in range(0, len(token_ids), window):
            model(torch.tensor([list(token_ids[start:start + window])], device=device))
    finally:
        for h in hooks:
            h.remove()
    return stats


def smoothquant_scales(act_absmax: Tensor, weights: Tensor | Sequence[Tensor], alpha: float = 0.5) -> Tensor:
    """s [in] with s_j = max|X_j|^alpha / max|W_j|^(1 - alpha). `weights`: one [out, in] or several sharing the
    input (q, k, v; gate, up): max|W_j| is taken over all their rows. Both maxima are clamped at 1e-5 so that a
    dead channel gives a finite s."""
    ws = [weights] if isinstance(weights, Tensor) else list(weights)
    w_absmax = torch.stack([w.detach().abs().amax(0).float() for w in ws]).amax(0)   # [in]
    if w_absmax.shape != act_absmax.shape:
        raise ValueError(f"weights have {w_absmax.shape[0]} input columns, act_absmax {act_absmax.shape[0]} channels")
    return act_absmax.float().clamp_min(1e-5).pow(alpha) / w_absmax.clamp_min(1e-5).pow(1 - alpha)


@torch.no_grad()
def smooth_model(model, calib_token_ids: Sequence[int], alpha: float = 0.5, window: int = 512) -> dict[str, Tensor]:
    """SmoothQuant a Llama-style HF model in place: for each decoder layer, divide input_layernorm's weight by
    s (from q/k/v, which read its output) and post_attention_layernorm's by s' (from gate/up), and multiply
    those linears' input columns by s (s'). In exact arithmetic the model computes the same function.
    o_proj and down_proj read no norm output, so nothing folds there for free; they are left alone (as in
    SmoothQuant's Llama recipe). Statistics come from `calib_token_ids`. Returns {norm name: s}."""
    layers = model.model.layers
    names = [f"model.layers.{i}.{p}" for i in range(len(layers)) for p in ("self_attn.q_proj", "mlp.gate_proj")]
    amax = activation_absmax(model, calib_token_ids, window, names)
    scales = {}
    for i, layer in enumerate(layers):
        at, mlp = layer.self_attn, layer.mlp
        for norm, linears, key in ((layer.input_layernorm, (at.q_proj, at.k_proj, at.v_proj), "self_attn.q_proj"),
                                   (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj), "mlp.gate_proj")):
            s = smoothquant_scales(amax[f"model.layers.{i}.{key}"], [lin.weight for lin in linears], alpha)
            norm.weight.div_(s.to(norm.weight.dtype))
            for lin in linears:
                lin.weight.mul_(s.to(lin.weight.dtype))    # column j (input channel j) times s_j
            scales[f"model.layers.{i}.{'input_layernorm' if key.startswith('self') else 'post_attention_layernorm'}"] = s
    return scales


def outlier_stats(act_absmax: dict[str, Tensor]) -> list[dict]:
    """For each {name: per-channel absmax [in]}: the largest channel, the median one, their ratio, and how many
    channels exceed 10x the median — the "outlier channels" SmoothQuant is about."""
    rows = []
    for name, a in act_absmax.items():
        med = a.median().clamp_min(1e-12)
        rows.append({"linear": name, "max": round(a.max().item(), 3), "median": round(med.item(), 4),
                     "max_over_median": round((a.max() / med).item(), 1), "argmax_channel": int(a.argmax()),
                     "channels_over_10x_median": int((a > 10 * med).sum())})
    return rows
