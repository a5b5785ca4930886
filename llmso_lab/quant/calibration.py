"""Calibration for activation-aware quantization (AWQ, GPTQ): what each Linear actually sees.

One forward of the model over a few hundred calibration tokens, with a forward pre-hook on every nn.Linear,
records each linear's input activations X [tokens, in_features]. From X come the two statistics the methods use:

- AWQ:  per-input-channel mean |x| (which channels carry large activations: their weights are "salient");
- GPTQ: the Hessian of the layer's squared output error, X^T X (how input channels co-vary).

The calibration text is a parameter (token ids), never read here: it must not overlap the text that is scored.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["linear_names", "collect_linear_inputs", "channel_mean_abs", "input_hessian"]


def linear_names(model: torch.nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> list[str]:
    """Names of the model's nn.Linear modules in forward order, except names ending in `skip`."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith(skip)]


@torch.no_grad()
def collect_linear_inputs(model: torch.nn.Module, token_ids: Sequence[int], names: Iterable[str] | None = None,
                          max_tokens: int = 512, seq_len: int | None = None) -> dict[str, Tensor]:
    """Run `model` (a Hugging Face causal LM) once over `token_ids[:max_tokens]` and return
    {linear name: its input activations, fp32 [tokens, in_features]} for the linears in `names`
    (default: every nn.Linear except lm_head).

    `seq_len=None`: the tokens are one sequence. Otherwise they are cut into rows of `seq_len` (a tail shorter
    than that is dropped) run as one batch: each row starts fresh, so the calibration data holds one first token
    per row. That matters: a model's first token is its "attention sink" (most attention goes to it, so an error
    in its keys / values reaches every later token), and its activations look like no other token's; with a
    single sequence GPTQ sees one such token and fits the rest at its expense.

    Linears fed the same tensor (q/k/v after the attention norm, gate/up after the MLP norm) share one copy.
    Memory: tokens * in_features * 4 bytes per distinct input (SmolLM2, 512 tokens: ~0.3 GB in all).
    """
    wanted = set(linear_names(model) if names is None else names)
    mods = {n: m for n, m in model.named_modules() if n in wanted}
    if missing := wanted - set(mods):
        raise KeyError(f"no such modules in the model: {sorted(missing)[:5]}")
    ids = list(token_ids[:max_tokens])
    if seq_len is not None:
        ids = ids[:len(ids) // seq_len * seq_len]
    if not ids:
        raise ValueError(f"need at least one calibration token (seq_len={seq_len}, {len(token_ids)} ids given)")
    out: dict[str, Tensor] = {}
    last: list = [None, None]   # (the input tensor last seen, its copy): q/k/v, gate/up get the same object in a row

    def hook(name):
        def pre(mod, args):
            x = args[0]
            if x is not last[0]:
                last[:] = [x, x.detach().reshape(-1, x.shape[-1]).to(torch.float32, copy=True)]
            out[name] = last[1]
        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in mods.items()]
    try:
        device = next(model.parameters()).device
        model(torch.tensor(ids, device=device).reshape(-1, seq_len or len(ids)))
    finally:
        for h in handles:
            h.remove()
        last.clear()
    return {n: out[n] for n in mods}   # forward order of named_modules


def channel_mean_abs(x: Tensor) -> Tensor:
    """Per-input-channel mean |x| of activations [tokens, in] -> [in] (AWQ's activation scale s_x)."""
    return x.abs().float().mean(0)


def input_hessian(x: Tensor) -> Tensor:
    """X^T X [in, in] of activations [tokens, in], in fp32 (fp64 for fp64 x): ||X W^T||^2 summed over outputs
    is tr(W X^T X W^T). GPTQ's Hessian is 2 X^T X / tokens."""
    x = x if x.dtype == torch.float64 else x.float()
    return x.T @ x
