"""Pruning (lecture 6): make a model cheaper by removing weights, one at a time or in whole structures.

- **Unstructured magnitude pruning**: in every weight matrix, zero the fraction `sparsity` of weights with the
  smallest |w|. Most flexible (hence the smallest loss at a given sparsity), but the zeros are scattered: a dense
  GEMM does the same work, and sparse kernels only pay off at very high sparsity. No speed-up by itself.
- **2:4 semi-structured sparsity**: in every group of 4 consecutive input weights of a row, keep the 2 largest
  |w|. Exactly 50% zeros in a fixed pattern that hardware understands (see `mask_2_4`).
- **Structured pruning**: remove whole attention heads (`prune_heads`) or MLP intermediate channels
  (`prune_mlp_channels`). The matrices physically shrink, so every dense kernel gets faster and smaller, but a
  whole channel is a coarse unit, and which channels matter is hard to tell from the weights alone (below).

Without retraining (all of this is one-shot, as here) the loss grows quickly with sparsity; in practice pruning
is followed by a short fine-tune or distillation (`llmso_lab.quant.distill`) to recover.

Measured on SmolLM2-135M (perplexity of the eval text's first 1,024 tokens, windows of 512; dense: 17.4):
- unstructured, every linear but the tied head: 10% 17.1, 20% 18.8, 30% 28.6, 50% 639, 70% 40,430, 80% 5.6e6
  (one-shot magnitude pruning of a small model; Wanda and SparseGPT, which use calibration data, are reported
  to do much better at 50%);
- 2:4 on every linear (also 50%): 1668, vs 639 unstructured -- the fixed pattern costs quality;
- MLP channels, activation-aware (calibration: tokens 1024..1535, not the scored ones): 10% 21.8, 20% 28.6,
  30% 46.9, 50% 184; weight-only importance: 10% already 7,762 (in 15 of the 30 layers its 10% cut includes
  the channel with the largest activation-aware importance);
- heads (least `head_importance` per KV group, every layer, physically removed): 1 of 3 per group (9 -> 6
  heads) 141, 2 of 3 (9 -> 3) 7,514; one head zeroed in a single layer: 17.5..18.6.

Weights W are [out, in] (nn.Linear's layout); "input dimension" = `in`, the one a dot product runs along.
"""
from __future__ import annotations

import copy
from typing import Callable, Iterator, Literal, Sequence

import torch
from torch import Tensor, nn

from llmso_lab.quant.calibration import linear_names

__all__ = ["magnitude_mask", "prune_unstructured", "mask_2_4", "is_2_4", "prune_2_4", "linear_sparsity",
           "head_importance", "prune_heads", "prune_heads_by_importance", "mlp_channel_importance",
           "mlp_activations", "prune_mlp_channels", "perplexity_sweep"]


# ---------------------------------------------------------------------------------------------- unstructured

def magnitude_mask(w: Tensor, sparsity: float) -> Tensor:
    """Bool mask, shape of `w`, True = keep: exactly round(sparsity * w.numel()) entries are False, those with the
    smallest |w|. Ties are broken by position (the earlier entry in row-major order is pruned first), so the mask
    is deterministic and masks for increasing sparsity are nested."""
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1] (a fraction of weights to zero), got {sparsity}")
    n_zero = round(sparsity * w.numel())
    a = w.detach().abs().flatten()
    keep = torch.ones(w.numel(), dtype=torch.bool, device=w.device)
    if n_zero:   # = a stable sort's first n_zero (ascending |w|, equal |w| in index order), without sorting
        t = a.kthvalue(n_zero).values                  # the n_zero-th smallest |w|
        keep &= a >= t                                 # everything smaller goes
        ties = (a == t).nonzero().flatten()            # then the earliest entries equal to t, as many as needed
        keep[ties[:n_zero - (a < t).sum()]] = False
    return keep.reshape(w.shape)


def _linears(model: nn.Module, skip: Sequence[str]) -> Iterator[tuple[str, nn.Linear]]:
    mods = dict(model.named_modules())
    return ((name, mods[name]) for name in linear_names(model, tuple(skip)))


@torch.no_grad()
def _apply_masks(model: nn.Module, make_mask: Callable[[Tensor], Tensor], skip: Sequence[str]) -> dict[str, Tensor]:
    masks = {}
    for name, lin in _linears(model, skip):
        masks[name] = make_mask(lin.weight)
        lin.weight.mul_(masks[name])
    return masks


def prune_unstructured(model: nn.Module, sparsity: float, skip: Sequence[str] = ("lm_head",)) -> dict[str, Tensor]:
    """Zero, in place, the `sparsity` fraction of smallest-|w| weights of every nn.Linear (each matrix on its own:
    the same sparsity in every layer), except names ending in `skip` (a tied LM head is the embedding: pruning it
    would prune the embedding too). Returns {linear name: keep mask}. Biases are left alone."""
    return _apply_masks(model, lambda w: magnitude_mask(w, sparsity), skip)


def linear_sparsity(model: nn.Module, skip: Sequence[str] = ("lm_head",)) -> float:
    """Fraction of exactly-zero weights over all nn.Linear weights (except `skip`)."""
    zeros = total = 0
    for _, lin in _linears(model, skip):
        zeros += int((lin.weight == 0).sum())
        total += lin.weight.numel()
    return zeros / max(total, 1)


# ---------------------------------------------------------------------------------------------- 2:4

def _groups_of_4(t: Tensor) -> Tensor:
    """[out, in] -> [out, in / 4, 4], or a clear error."""
    if t.dim() != 2 or t.shape[1] % 4:
        raise ValueError(f"2:4 sparsity needs a 2-D weight [out, in] with `in` divisible by 4, got shape "
                         f"{tuple(t.shape)}; skip this layer or pad its input dimension to a multiple of 4")
    return t.reshape(t.shape[0], t.shape[1] // 4, 4)


def mask_2_4(w: Tensor) -> Tensor:
    """Bool mask [out, in], True = keep: in every group of 4 consecutive input weights (w[r, 4j:4j+4]) the 2 largest
    |w| are kept (on ties the earlier position wins).

    Where the speed-up comes from: NVIDIA's sparse tensor cores (Ampere and newer: A100, H100, RTX 30xx+) multiply
    a 2:4 matrix stored compressed -- the 2 kept values of each group plus a 2-bit index each -- at twice the dense
    math rate, and read about half the weight bytes. In PyTorch: `torch.sparse.to_sparse_semi_structured(W)` on a
    CUDA fp16/bf16/int8 weight that already has this pattern, then `F.linear(x, W_sparse)` (cuSPARSELt or CUTLASS
    kernels). Only the GEMMs speed up, and not all shapes reach 2x, so end-to-end 1.2-1.5x is typical in practice.
    On CPU there is no such kernel: a 2:4-pruned model here runs exactly as fast as the dense one (we only
    measure what it costs in quality).
    """
    g = _groups_of_4(w.detach().abs())
    top2 = torch.sort(g, dim=-1, descending=True, stable=True).indices[..., :2]   # [out, in/4, 2]
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, top2, True)
    return keep.reshape(w.shape)


def is_2_4(w_or_mask: Tensor) -> bool:
    """True if every group of 4 consecutive input positions of a weight (nonzeros) or a bool mask (True entries)
    has at most 2 of them. Raises ValueError if the input dimension is not divisible by 4."""
    return bool(((_groups_of_4(w_or_mask) != 0).sum(-1) <= 2).all())


def prune_2_4(model: nn.Module, skip: Sequence[str] = ("lm_head",)) -> dict[str, Tensor]:
    """Apply `mask_2_4` in place to every nn.Linear except names ending in `skip`. Returns {name: keep mask}."""
    return _apply_masks(model, mask_2_4, skip)


# ---------------------------------------------------------------------------------------------- attention heads

def _layers(model: nn.Module):
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or not all(hasattr(l, "self_attn") and hasattr(l, "mlp") for l in layers):
        raise ValueError(f"{type(model).__name__} is not a Llama-style model (model.model.layers[i].self_attn / .mlp); "
                         "structured pruning here supports Llama, Mistral, Qwen2 and similar")
    return layers


def head_importance(model: nn.Module, layer_idx: int) -> Tensor:
    """fp32 [query heads of the layer]: ||o_proj.weight[:, h*D:(h+1)*D]||_F for each head h.

    A weight-only proxy: a head adds o_proj_h @ (attention-weighted values) to the residual stream, and since the
    values (and keys) are shared by the query heads of a GQA group, o_proj's slice is the only head-specific factor
    of how much it can write. (The better, costlier measure is the loss increase when the head is removed.)"""
    attn = _layers(model)[layer_idx].self_attn
    w = attn.o_proj.weight.detach().float()
    return w.reshape(w.shape[0], -1, attn.head_dim).norm(dim=(0, 2))


@torch.no_grad()
def _keep_rows(lin: nn.Linear, rows: Tensor) -> None:
    lin.weight = nn.Parameter(lin.weight[rows].contiguous(), requires_grad=lin.weight.requires_grad)
    if lin.bias is not None:
        lin.bias = nn.Parameter(lin.bias[rows].contiguous(), requires_grad=lin.bias.requires_grad)
    lin.out_features = len(rows)


@torch.no_grad()
def _keep_cols(lin: nn.Linear, cols: Tensor) -> None:
    lin.weight = nn.Parameter(lin.weight[:, cols].contiguous(), requires_grad=lin.weight.requires_grad)
    lin.in_features = len(cols)


def _head_rows(heads: Sequence[int], head_dim: int) -> Tensor:
    """Row indices of whole heads in a [heads * D, ...] projection."""
    return (torch.tensor(list(heads), dtype=torch.long)[:, None] * head_dim + torch.arange(head_dim)).flatten()


@torch.no_grad()
def prune_heads(model: nn.Module, layer_idx: int, heads: Sequence[int]) -> Literal["shrunk", "zeroed"]:
    """Remove query heads `heads` (indices among the layer's current query heads) of layer `layer_idx`, in place.

    With GQA (SmolLM2: 9 query heads reading 3 KV heads, query head h reads KV head h // 3) Hugging Face repeats
    each KV head for `num_key_value_groups` CONSECUTIVE query heads, the same number for every KV head. So:

    - "shrunk" (physical) when every KV group keeps the same number of query heads, or none: q_proj loses the
      heads' rows, o_proj their columns, `num_key_value_groups` becomes the new group size, and a KV group that
      keeps no query head is removed too (its k_proj/v_proj rows: a smaller KV cache). Fewer FLOPs and bytes.
    - "zeroed" otherwise (e.g. 1 head out of one group only): the heads' q_proj rows and o_proj columns are set to
      zero. Same outputs as removing them, but no saving -- the layout stays that of the full layer.

    `config.num_attention_heads` is left as is (it is one number for all layers; HF's attention infers the head
    count of each layer from its q_proj). Returns which of the two happened.
    """
    attn = _layers(model)[layer_idx].self_attn
    d = attn.head_dim
    n_heads, group = attn.q_proj.out_features // d, attn.num_key_value_groups
    drop = set(int(h) for h in heads)
    if not drop <= set(range(n_heads)):
        raise ValueError(f"heads {sorted(drop)} out of range: layer {layer_idx} has {n_heads} query heads "
                         f"(0..{n_heads - 1})")
    if len(drop) == n_heads:
        raise ValueError(f"cannot remove all {n_heads} heads of layer {layer_idx}; keep at least one")
    keep = [h for h in range(n_heads) if h not in drop]
    kept_per_group = [sum(1 for h in keep if h // group == j) for j in range(n_heads // group)]
    sizes = set(kept_per_group) - {0}
    if len(sizes) == 1:
        kv_keep = [j for j, n in enumerate(kept_per_group) if n]
        _keep_rows(attn.q_proj, _head_rows(keep, d))
        _keep_cols(attn.o_proj, _head_rows(keep, d))
        for proj in (attn.k_proj, attn.v_proj):
            _keep_rows(proj, _head_rows(kv_keep, d))
        attn.num_key_value_groups = sizes.pop()      # what HF's attention uses to repeat K/V per query head
        return "shrunk"
    rows = _head_rows(sorted(drop), d)
    attn.q_proj.weight[rows] = 0
    if attn.q_proj.bias is not None:
        attn.q_proj.bias[rows] = 0
    attn.o_proj.weight[:, rows] = 0
    return "zeroed"


def prune_heads_by_importance(model: nn.Module, per_group: int) -> dict[int, list[int]]:
    """In every layer, remove the `per_group` least important query heads (`head_importance`) of each KV group --
    uniform, so every layer shrinks physically. Returns {layer: removed head indices}."""
    removed = {}
    for i, layer in enumerate(_layers(model)):
        attn = layer.self_attn
        group = attn.num_key_value_groups
        if not 0 <= per_group < group:
            raise ValueError(f"per_group must be in 0..{group - 1} (layer {i} has {group} query heads per KV head)")
        imp = head_importance(model, i).reshape(-1, group)                  # [KV heads, group]
        order = torch.sort(imp, dim=1, stable=True).indices[:, :per_group]  # least important first
        removed[i] = sorted((order + torch.arange(imp.shape[0])[:, None] * group).flatten().tolist())
        if removed[i]:
            prune_heads(model, i, removed[i])
    return removed


# ---------------------------------------------------------------------------------------------- MLP channels

def mlp_channel_importance(mlp: nn.Module, activations: Tensor | None = None) -> Tensor:
    """fp32 [intermediate]: how much each intermediate channel j of a Llama MLP can matter.

    Channel j computes a_j = silu(gate_j . x) * (up_j . x) and adds a_j * down[:, j] to the residual stream.
    - `activations=None` (weight-only, no data): ||gate_proj.weight[j]|| * ||up_proj.weight[j]|| *
      ||down_proj.weight[:, j]|| (L2 norms), a bound on that contribution for a given |x| (|silu(z)| <= |z|).
    - `activations` [tokens, intermediate] (the input of down_proj on calibration text, see
      `mlp_activations`): mean |a_j| * ||down_proj.weight[:, j]||, the channel's average contribution. Much
      better on real models, whose few very active channels can have unremarkable weights.
    """
    dn = mlp.down_proj.weight.detach().float().norm(dim=0)
    if activations is not None:
        return activations.float().abs().mean(0) * dn
    g, u = (m.weight.detach().float() for m in (mlp.gate_proj, mlp.up_proj))
    return g.norm(dim=1) * u.norm(dim=1) * dn


@torch.no_grad()
def mlp_activations(model: nn.Module, token_ids: Sequence[int], window: int = 512) -> list[Tensor]:
    """Per layer, the input of down_proj (a = silu(gate x) * up x) at every token of `token_ids`:
    fp32 [tokens, intermediate] each, from forwards over windows of `window` tokens."""
    acts: list[list[Tensor]] = [[] for _ in _layers(model)]
    hooks = [layer.mlp.down_proj.register_forward_pre_hook(lambda _m, args, i=i: acts[i].append(args[0][0].float()))
             for i, layer in enumerate(_layers(model))]
    try:
        for start in range(0, len(token_ids), window):
            model(torch.tensor([list(token_ids[start:start + window])]))
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(a) for a in acts]


@torch.no_grad()
def prune_mlp_channels(model: nn.Module, fraction: float, calibration_ids: Sequence[int] | None = None) -> int:
    """Remove, in place, the `fraction` of intermediate channels with the lowest `mlp_channel_importance` in every
    MLP (activation-aware when `calibration_ids` are given -- use text that is not your evaluation text --,
    weight-only otherwise): gate_proj and up_proj lose rows, down_proj columns (physically smaller matrices).
    Every layer keeps the same number, round((1 - fraction) * intermediate_size), because the config holds one
    intermediate_size. Returns the new intermediate size (also written to `config.intermediate_size`)."""
    layers = _layers(model)
    sizes = {layer.mlp.down_proj.in_features for layer in layers}
    if len(sizes) != 1:
        raise ValueError(f"MLPs of different intermediate sizes {sorted(sizes)}; prune a model with uniform MLPs")
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1) (share of channels to remove), got {fraction}")
    size = sizes.pop()
    n_keep = max(1, round((1.0 - fraction) * size))
    acts = mlp_activations(model, calibration_ids) if calibration_ids is not None else [None] * len(layers)
    for layer, a in zip(layers, acts):
        mlp = layer.mlp
        best = torch.sort(mlp_channel_importance(mlp, a), descending=True, stable=True).indices[:n_keep]
        keep = torch.sort(best).values             # keep the original channel order (not needed, but tidy)
        _keep_rows(mlp.gate_proj, keep)
        _keep_rows(mlp.up_proj, keep)
        _keep_cols(mlp.down_proj, keep)
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = n_keep
    model.config.intermediate_size = n_keep
    return n_keep


# ---------------------------------------------------------------------------------------------- sweeps

def perplexity_sweep(model: nn.Module, token_ids: Sequence[int], prune: Callable[[nn.Module, float], object],
                     amounts: Sequence[float], window: int = 512, desc: str | None = None) -> list[tuple[float, float]]:
    """[(amount, perplexity)] of `prune(copy, amount)` applied to a fresh deep copy of `model` for each amount
    (the input model is untouched). E.g. `perplexity_sweep(model, ids, prune_unstructured, [0, 0.3, 0.5])` or
    `perplexity_sweep(model, ids, lambda m, f: prune_mlp_channels(m, f, calibration_ids), [0.1, 0.2])`.
    `desc`: show a tqdm progress bar with this label (each point is a full perplexity run)."""
    from tqdm.auto import tqdm

    from llmso_lab.quality import perplexity

    rows = []
    for amount in tqdm(amounts, desc=desc, disable=desc is None):
        pruned = copy.deepcopy(model)
        prune(pruned, amount)
        rows.append((amount, perplexity(pruned, token_ids, window=window)))
        del pruned
    return rows
