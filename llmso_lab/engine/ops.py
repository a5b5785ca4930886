"""The engine's ops: a leaf module (torch only) that the model runner, its MLA layers, the drafters, the benches and
`hardware` import. Each op is written so that its bits equal Hugging Face's (fp32) where the engine is compared
with it token for token; the comments say where a cheaper form was chosen and why it is still exact.

- `linear`: x @ W (+ bias) for the engine's weight layout [in, out], or a prepacked / quantized matmul object;
- `OneDNNLinear`: a weight prepacked for oneDNN (`hardware.onednn_linear_available` says where it wins);
- `rms_norm`, `rope_cos_sin`, `apply_rope`: Llama's RMSNorm and rotary embedding;
- `swiglu_mlp`: the SwiGLU MLP with gate and up fused in one matmul.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def cat_weights(*ts: Tensor | None) -> Tensor | None:
    return None if ts[0] is None else torch.cat([t.detach() for t in ts]).contiguous()


def transposed(w: Tensor, dtype: torch.dtype) -> Tensor:
    """HF Linear weight [out, in] -> [in, out] contiguous in `dtype`: `x @ w` is then ~15% faster on CPU for few rows."""
    return w.detach().to(dtype).t().contiguous()


def linear(x: Tensor, w_t, bias: Tensor | None = None) -> Tensor:
    """x [T, in] @ w_t [in, out] (+ bias) -> [T, out]. `w_t` may instead be a weight-only quantized matmul
    (`llmso_lab.quant.weight_only`), called on x."""
    if not isinstance(w_t, Tensor):
        y = w_t(x)
        return y if bias is None else y + bias
    return x @ w_t if bias is None else torch.addmm(bias, x, w_t)


class OneDNNLinear:
    """A weight prepacked once into oneDNN's blocked layout for its linear kernel (what PyTorch's CPU compiler emits,
    and what vLLM's CPU backend does at load: `onednn_mm`): x [T, in] -> [T, out]. bf16: on CPUs with AMX /
    AVX512-BF16 the plain `x @ w` takes a slow matrix-vector path for a few rows (batch-1 decode ran at half fp32's
    speed although it reads half the bytes). fp32: the packed kernel ran SmolLM2's gate/up matrix ~1.9x faster at 1
    row, ~1.3x at 16 and ~1.2x at 512 than `x @ w` here (Lab 01, section 9), so it is used where a quick measurement
    on this CPU says it wins (`hardware.onednn_linear_available`). `llmso-lab bench precision` reports which kernel ran."""

    def __init__(self, w_t: Tensor) -> None:
        self.shape, self.dtype = tuple(w_t.shape), w_t.dtype   # [in, out], as the engine's other weights
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w_t.t().contiguous(), 1)   # [out, in], blocked layout

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    @property
    def in_features(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize


def rope_cos_sin(config, max_positions: int) -> tuple[Tensor, Tensor]:
    """cos/sin tables [max_positions, D] in fp32, as HF's rotary embedding computes them."""
    params = getattr(config, "rope_parameters", None)
    if not params:   # transformers 4.x keeps them in rope_theta + rope_scaling
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = 1.0
    if rope_type == "llama3":   # Llama 3.1: stretch low frequencies by `factor`, blend the middle band
        factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
        inv_freq = torch.where(is_mid, smoothed, scaled)
    elif rope_type != "default":   # linear, dynamic, yarn, longrope: use HF's own initialiser
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]    # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                      # [P, D]
    return emb.cos() * scaling, emb.sin() * scaling


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF LlamaRMSNorm: normalise in fp32, cast back, then scale (bitwise equal to HF's module).
    (`F.rms_norm` gives the same bits in fp32 but launches more kernels: it is slower for decode batches.)"""
    h = x.float()
    h = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps)   # h * h: the same bits as HF's h.pow(2), and on
    return weight * h.to(x.dtype)                               # CPU ~10x cheaper for one token (pow is slow there)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x [T, heads, D], cos/signed_sin [T, 1, D]. HF's `x * cos + rotate_half(x) * sin` with
    rotate_half(x) = cat(-x2, x1) = swap_halves(x) * [-1.., +1..]: the sign lives in `signed_sin` (bitwise
    equal). Swapping the halves is one flip of a [.., 2, D/2] view: one kernel instead of roll's three."""
    T, heads, D = x.shape
    swapped = x.reshape(T, heads, 2, D // 2).flip(2).view(T, heads, D)
    return x * cos + swapped * signed_sin


def swiglu_mlp(x: Tensor, gate_up, gate_up_bias: Tensor | None, down, down_bias: Tensor | None) -> Tensor:
    """Llama's MLP, down(silu(gate(x)) * up(x)), with gate and up as one matmul [hidden, 2 I] (`cat_weights`)."""
    gate, up = linear(x, gate_up, gate_up_bias).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down, down_bias)
