"""AWQ, activation-aware weight quantization (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for
LLM Compression and Acceleration").

A few input channels of a linear carry much larger activations than the rest; the weights that multiply them
matter most ("salient"). Rounding hurts them as much as any other weight, but their error is amplified by the big
activation. AWQ protects them without mixed precision: scale input channel i of the weight up by s_i before
rounding and divide the activation by s_i,

    y = x W^T = (x / s) (W * s)^T   ~   (x / s) Q(W * s)^T,

so a salient column is rounded on a relatively finer grid (its group's scale is shared with unscaled columns, so
its relative error shrinks). s comes from the activations: s = s_x^alpha with s_x = mean |x| per input channel,
and alpha in [0, 1) is picked by a small grid search that minimises the layer's output error on calibration data:

    loss(alpha) = mean (X Wq(alpha)^T - X W^T)^2,   Wq(alpha) = Q(W * s) / s

alpha = 0 gives s = 1, i.e. plain RTN, so on the calibration data AWQ is never worse than RTN.

What this module does, and how it differs from the reference implementation (llm-awq):
- Fake quantization: the linear's weight is replaced by Q(W * s) / s, which the unchanged HF model computes with.
  Dividing s back into the weight is the same maths as folding 1/s into the op that feeds the linear (the
  RMSNorm weight for q/k/v and gate/up, v_proj for o_proj, up_proj for down_proj), which is how a real
  deployment keeps an integer kernel.
- Simple variant: every linear is searched on its own, with inputs recorded from the unquantized (fp32) model
  in one forward (so q, k and v may get different s: folding them into the one norm that feeds all three would
  need a shared s). The reference searches one s per group of linears that share an input (q/k/v; gate/up), so
  that it can be folded into the norm, measures the loss on the whole block's output, feeds each block the
  output of the already-quantized blocks before it, and follows the scale search with a weight-clipping search.
  None of that is done here.

SmolLM2-135M, perplexity on the eval text's first 1024 tokens (fp32 17.44), calibrated on other tokens in rows
of 128, groups of 64: 4-bit asymmetric RTN 24.1 -> AWQ 19.9, symmetric 27.4 -> 21.8; 3-bit asymmetric 135 -> 36,
symmetric 196 -> 123 (256 calibration tokens for asymmetric, 512 for symmetric). The chosen alphas average about 0.3 (v_proj about 0.55, o_proj the lowest).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from llmso_lab.quant.calibration import channel_mean_abs, collect_linear_inputs, linear_names
from llmso_lab.quant.rtn import fake_quantize

__all__ = ["AWQResult", "awq_scales", "awq_fake_quantize", "output_error", "awq_search", "awq_quantize_model",
           "awq_best_scales", "awq_fold_for_engine"]


@dataclass(slots=True)
class AWQResult:
    """One linear's search: the chosen per-input-channel scales and alpha, its loss and plain RTN's."""
    scales: Tensor                 # s [in], fp32: the weight's input channels were multiplied by s before rounding
    alpha: float                   # s = normalised s_x ** alpha
    loss: float                    # mean squared output error on the calibration inputs with these scales
    rtn_loss: float                # the same for plain RTN (alpha = 0)
    losses: list[float] = field(default_factory=list)   # loss for every alpha of the grid, in grid order

    @property
    def alphas(self) -> list[float]:
        return [i / len(self.losses) for i in range(len(self.losses))]


def awq_scales(s_x: Tensor, alpha: float) -> Tensor:
    """s = s_x ** alpha, clamped at 1e-4, divided by sqrt(max(s) * min(s)) so that the largest and smallest
    scales are reciprocal (as the reference does). alpha = 0 gives exactly ones."""
    s = s_x.float().pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def awq_fake_quantize(w: Tensor, scales: Tensor, bits: int = 4, group_size: int | None = 64,
                      symmetric: bool = True) -> Tensor:
    """Q(W * s) / s (fp32 [out, in]): round W with its input channels scaled by s, then undo the scaling.
    Scales of ones give exactly RTN's `fake_quantize`."""
    s = scales.float()
    return fake_quantize(w.float() * s, bits, group_size=group_size, symmetric=symmetric) / s


def output_error(x: Tensor, w: Tensor, w_q: Tensor) -> float:
    """mean over tokens and outputs of (x W_q^T - x W^T)^2, x [N, in] (computed as x (W_q - W)^T)."""
    return float((x.float() @ (w_q.float() - w.float()).T).pow(2).mean())


@torch.no_grad()
def awq_search(w: Tensor, x: Tensor, bits: int = 4, group_size: int | None = 64, symmetric: bool = True,
               grid: int = 20) -> AWQResult:
    """Search alpha in {0, 1/grid, ..., (grid-1)/grid} for one linear: weight [out, in], calibration inputs
    x [N, in]. Returns the scales of the alpha with the lowest output error (the first one on ties, so alpha = 0,
    plain RTN, unless something is strictly better)."""
    if grid < 1:
        raise ValueError(f"grid must be >= 1, got {grid}")
    w, x = w.detach().float(), x.detach().float()
    s_x = channel_mean_abs(x)
    losses, best = [], None
    for i in range(grid):
        s = awq_scales(s_x, i / grid)
        loss = output_error(x, w, awq_fake_quantize(w, s, bits, group_size, symmetric))
        losses.append(loss)
        if best is None or loss < best[0]:
            best = (loss, i / grid, s)
    loss, alpha, s = best
    return AWQResult(scales=s, alpha=alpha, loss=loss, rtn_loss=losses[0], losses=losses)


@torch.no_grad()
def awq_quantize_model(model: torch.nn.Module, calib_token_ids: Sequence[int], bits: int = 4,
                       group_size: int | None = 64, symmetric: bool = True, grid: int = 20,
                       skip: tuple[str, ...] = ("lm_head",), max_tokens: int = 512,
                       seq_len: int | None = 128) -> dict[str, AWQResult]:
    """AWQ every nn.Linear of a Hugging Face causal LM in place (fake quant: each weight becomes Q(W * s) / s in
    its own dtype), except names ending in `skip` (lm_head, tied with the embedding, by default).

    Simple variant: the inputs of all linears are recorded in one forward of the unquantized model over
    `calib_token_ids[:max_tokens]` (in rows of `seq_len` tokens, see `collect_linear_inputs`; None: one
    sequence), and each linear is searched on its own (see the module docstring). The calibration ids must not
    overlap the text you score. Returns {linear name: AWQResult}.
    """
    names = linear_names(model, skip)
    inputs = collect_linear_inputs(model, calib_token_ids, names, max_tokens, seq_len)
    mods = dict(model.named_modules())
    results: dict[str, AWQResult] = {}
    for name in names:
        lin, x = mods[name], inputs.pop(name)    # pop: an input is freed once its last linear is done
        w = lin.weight.detach()
        r = awq_search(w, x, bits, group_size, symmetric, grid)
        lin.weight.data.copy_(awq_fake_quantize(w, r.scales, bits, group_size, symmetric).to(w.dtype))
        results[name] = r
    return results


def awq_best_scales(w: Tensor, x: Tensor, bits: int = 4, group_size: int | None = 64, grid: int = 20) -> Tensor:
    """The scales `awq_search` picks for one linear with symmetric RTN (Lab 06's exercise): s [in]."""
    return awq_search(w, x, bits, group_size, True, grid).scales


@torch.no_grad()
def awq_fold_for_engine(model: torch.nn.Module, calib_token_ids: Sequence[int], bits: int = 4, group_size: int = 32,
                        grid: int = 20, max_tokens: int = 512, seq_len: int | None = 128) -> torch.nn.Module:
    """AWQ as a deployed model is: scales folded into the weights, so that plain RTN of the result *is* the AWQ
    quantization and the engine's int4 kernels (`LLM(quantization="int4")`, asymmetric) run it unchanged.

    For each decoder layer of a Llama-style HF model, in place and in exact arithmetic function-preserving:
    - q/k/v read input_layernorm's output: one joint search over [W_q; W_k; W_v] (they share s), then
      input_layernorm.weight /= s and their input columns *= s;
    - gate/up read post_attention_layernorm's output: the same with [W_gate; W_up];
    - down reads silu(gate) * up: up_proj's output rows /= s, down_proj's input columns *= s.
    o_proj is left alone: its input channels come from V heads that several query heads share (GQA), so one
    scale per channel cannot be folded into v_proj (AutoAWQ skips it for GQA models too). The lm_head stays.
    Inputs come from one forward of the unmodified model over `calib_token_ids[:max_tokens]` in rows of `seq_len`
    (see `collect_linear_inputs`). Returns `model`.
    """
    layers = model.model.layers
    names = [f"model.layers.{i}.{p}" for i in range(len(layers)) for p in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj")]
    inputs = collect_linear_inputs(model, calib_token_ids, names, max_tokens, seq_len)
    for i, layer in enumerate(layers):
        at, mlp = layer.self_attn, layer.mlp
        for key, prev, linears in ((f"model.layers.{i}.self_attn.q_proj", layer.input_layernorm, (at.q_proj, at.k_proj, at.v_proj)),
                                   (f"model.layers.{i}.mlp.gate_proj", layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj)),
                                   (f"model.layers.{i}.mlp.down_proj", mlp.up_proj, (mlp.down_proj,))):
            w = torch.cat([lin.weight.detach().float() for lin in linears])          # [sum out, in]: one joint search
            s = awq_search(w, inputs.pop(key), bits, group_size, False, grid).scales
            if isinstance(prev, torch.nn.Linear):
                prev.weight.div_(s[:, None].to(prev.weight.dtype))                    # up_proj's output rows
            else:
                prev.weight.div_(s.to(prev.weight.dtype))                             # the RMSNorm's gain
            for lin in linears:
                lin.weight.mul_(s.to(lin.weight.dtype))                               # input column j times s_j
    return model
