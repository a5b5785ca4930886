"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): quantize a weight column by column and push each column's rounding error onto the columns not
yet quantized, weighted by second-order (inverse Hessian) information, so that the layer's output on
calibration data moves as little as possible.

For one linear with calibration inputs X [N, in], the layer-wise objective ||X Wq^T - X W^T||^2 has the Hessian
(per output row) H = 2 X^T X / N. Optimal Brain Quantization says: after rounding column j (error w_j - q_j),
the best update of the remaining columns F is

    W[:, F] -= (w_j - q_j) / Hinv_F[j, j] * Hinv_F[j, F],

with Hinv_F the inverse of H restricted to the columns not yet quantized, which then drops j. GPTQ's insight:
processed left to right, row j of the Cholesky factor U of H^-1 (H^-1 = U^T U, U upper triangular) holds
exactly Hinv_F[j, F] / sqrt(Hinv_F[j, j]) for every j, so one Cholesky replaces all those updates:

    err = (w_j - q_j) / U[j, j];   W[:, j+1:] -= err * U[j, j+1:]

Damping adds percdamp * mean(diag H) to the diagonal (numerical safety); a "dead" input channel (always zero in
the calibration data, H[j, j] = 0) gets H[j, j] = 1 and a zero weight. Lazy batches: the updates to columns
beyond the current block of 128 are accumulated and applied once per block (same result, fewer memory passes).
Group scales are computed when a group starts, from the current, error-updated weights, as the reference does
(here a group always starts at a block start, so those weights have received every earlier column's update).

`gptq_quantize_model` is the simple variant: every linear is quantized from inputs recorded in one forward of
the unquantized (fp32) model, not sequentially from the outputs of already-quantized layers as the reference
does; no act-order (columns are processed in their natural order).

GPTQ fits its calibration data, so it needs enough of it, and of the right kind. The reference uses 128 rows of
2048 tokens; a teaching run has a few hundred to a few thousand tokens, fewer than a 1536-wide layer has inputs,
so H is (nearly) singular and the error is pushed into directions the calibration text never used. Two things
keep that in check on SmolLM2: several rows rather than one long sequence (each row's first token is an
attention sink, whose keys and values every later token reads, and whose activations look like no other
token's: calibrated on one sequence, GPTQ made the sink's q/k/v error 4-5x larger than RTN's and perplexity
worse than RTN's), and more damping (percdamp 0.1 rather than the reference's 0.01).

SmolLM2-135M, perplexity on the eval text's first 1024 tokens (fp32 17.44), 3-bit symmetric groups of 64
(RTN 195.5): GPTQ calibrated on 1536 tokens as one sequence 368, in rows of 128 with percdamp 0.01 167, rows of
128 with percdamp 0.1 110.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from llmso_lab.quant.calibration import collect_linear_inputs, input_hessian, linear_names
from llmso_lab.quant.rtn import QuantizedTensor, fake_quantize, grid_codes, grid_params, grid_values, pack_bits

__all__ = ["GPTQResult", "gptq_hessian", "gptq_quantize", "gptq_quantize_packed", "gptq_quantize_model"]


def gptq_hessian(x: Tensor) -> Tensor:
    """H = 2 X^T X / N (fp32 [in, in]) for calibration inputs x [N, in]."""
    return input_hessian(x) * (2.0 / x.shape[0])


@torch.no_grad()
def gptq_quantize_packed(w: Tensor, h: Tensor, bits: int = 4, group_size: int | None = 64, symmetric: bool = True,
                         percdamp: float = 0.01, blocksize: int = 128) -> QuantizedTensor:
    """GPTQ one weight [out, in] given its Hessian h [in, in]; returns the codes and group scales (packed, like
    `rtn.quantize`). `group_size=None`: one grid per output row, from the whole row before any update.
    Works in fp64 when w is fp64 (scales too), else fp32."""
    if w.dim() != 2 or h.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"expected w [out, in] and h [in, in], got {tuple(w.shape)} and {tuple(h.shape)}")
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in 2..8, got {bits}")
    out_f, in_f = w.shape
    g = in_f if group_size is None else group_size
    if g <= 0 or in_f % g:
        raise ValueError(f"group_size={group_size} does not divide the {in_f} input features")
    dt = torch.float64 if w.dtype == torch.float64 else torch.float32
    W = w.detach().to(dt, copy=True)
    H = h.detach().to(dt, copy=True)
    # every group must start at a block start (its grid then sees every earlier column's update)
    block = blocksize if g == in_f or g % blocksize == 0 else g * max(1, blocksize // g)
    Q = torch.zeros_like(W)                                   # integer-valued codes
    scale = W.new_zeros(out_f, in_f // g)
    minimum = None if symmetric else W.new_zeros(out_f, in_f // g)
    with _one_thread():
        dead = torch.diag(H) == 0
        H[dead, dead] = 1
        W[:, dead] = 0
        H.diagonal().add_(percdamp * torch.mean(torch.diag(H)))
        L, info = torch.linalg.cholesky_ex(H)
        if info:
            raise ValueError(f"the damped Hessian is not positive definite (percdamp={percdamp}); raise percdamp "
                             f"or use more calibration tokens")
        U = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)   # H^-1 = U^T U
        _columns(W, U, Q, scale, minimum, bits, g, block, symmetric)
    codes = (Q if minimum is not None else Q + (1 << (bits - 1))).to(torch.uint8)
    return QuantizedTensor(pack_bits(codes, bits), scale, minimum, bits, g, (out_f, in_f))


@contextmanager
def _one_thread():
    """GPTQ's column loop is thousands of tiny ops and its matrices are small: one intra-op thread is faster, and
    much faster when the CPU is shared with other processes (a parallel region waits for its slowest thread:
    cholesky_inverse of 576 x 576 took 1.8 s with 2 threads on a busy 2-core machine, 3 ms with 1)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _columns(W: Tensor, U: Tensor, Q: Tensor, scale: Tensor, minimum: Tensor | None, bits: int, g: int,
             block: int, symmetric: bool) -> None:
    """GPTQ's column loop, in place: W (updated as columns are quantized), Q (codes), scale / minimum (grids)."""
    in_f = W.shape[1]
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        W1, U1 = W[:, i1:i2], U[i1:i2, i1:i2]                 # W1: a view, updated in place
        E1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            j = i1 + i
            if j % g == 0:                                     # a new group: its grid from the current weights
                s, m = grid_params(W[:, j:j + g], bits, symmetric)
                scale[:, j // g] = s
                if m is not None:
                    minimum[:, j // g] = m
            q = grid_codes(W1[:, i, None], s, m, bits)         # [out, 1]
            Q[:, j] = q[:, 0]
            err = (W1[:, i] - grid_values(q, s, m)[:, 0]) / U1[i, i]
            W1[:, i + 1:] -= err[:, None] * U1[i, None, i + 1:]
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]                        # lazy update of the columns after the block


def gptq_quantize(w: Tensor, h: Tensor, bits: int = 4, group_size: int | None = 64, symmetric: bool = True,
                  percdamp: float = 0.01, blocksize: int = 128) -> Tensor:
    """GPTQ one weight [out, in] given its Hessian h [in, in] (see `gptq_hessian`); returns the dequantized
    weight, in w's dtype."""
    return gptq_quantize_packed(w, h, bits, group_size, symmetric, percdamp, blocksize).dequantize().to(w.dtype)


@dataclass(slots=True)
class GPTQResult:
    """One linear: its GPTQ codes and grid, and the calibration output error of GPTQ and of plain RTN."""
    qweight: QuantizedTensor
    loss: float        # mean (X Wq^T - X W^T)^2 on the calibration inputs
    rtn_loss: float    # the same for RTN with the same bits / group / symmetry


@torch.no_grad()
def gptq_quantize_model(model: torch.nn.Module, calib_token_ids: Sequence[int], bits: int = 4,
                        group_size: int | None = 64, symmetric: bool = True, percdamp: float = 0.1,
                        blocksize: int = 128, skip: tuple[str, ...] = ("lm_head",),
                        max_tokens: int = 512, seq_len: int | None = 128) -> dict[str, GPTQResult]:
    """GPTQ every nn.Linear of a Hugging Face causal LM in place (fake quant: each weight becomes its dequantized
    GPTQ value in its own dtype), except names ending in `skip` (lm_head, tied with the embedding, by default).

    Simple variant: the inputs of all linears come from one forward of the unquantized model over
    `calib_token_ids[:max_tokens]` in rows of `seq_len` tokens (None: one sequence; see the module docstring for
    why rows), not sequentially through the quantized layers. The calibration ids must not overlap the text you
    score. `percdamp` defaults to 0.1, not the reference's 0.01: with a few hundred calibration tokens 0.01
    overfits (SmolLM2, 3-bit asymmetric groups of 64, 512 tokens: perplexity 155 against RTN's 135; 0.1: 76).
    Returns {linear name: GPTQResult}.
    """
    names = linear_names(model, skip)
    inputs = collect_linear_inputs(model, calib_token_ids, names, max_tokens, seq_len)
    mods = dict(model.named_modules())
    results: dict[str, GPTQResult] = {}
    hess: tuple[Tensor, Tensor] | None = None                 # (input, its Hessian): q/k/v and gate/up share one
    for name in names:
        lin, x = mods[name], inputs.pop(name)
        if hess is None or hess[0] is not x:
            hess = (x, gptq_hessian(x))
        w = lin.weight.detach()
        qt = gptq_quantize_packed(w, hess[1], bits, group_size, symmetric, percdamp, blocksize)
        wq = qt.dequantize()
        rtn = fake_quantize(w.float(), bits, group_size=group_size, symmetric=symmetric)
        results[name] = GPTQResult(qt, _output_error(hess[1], w, wq), _output_error(hess[1], w, rtn))
        lin.weight.data.copy_(wq.to(w.dtype))
    return results


def _output_error(h: Tensor, w: Tensor, w_q: Tensor) -> float:
    """`awq.output_error` from GPTQ's Hessian h = 2 X^T X / N: mean (X D^T)^2 = tr(D h D^T) / (2 out), D = W_q - W
    (cheaper than through X when there are more calibration tokens than inputs)."""
    d = w_q.float() - w.float()
    return float(((d @ h) * d).sum()) / (2 * d.shape[0])
