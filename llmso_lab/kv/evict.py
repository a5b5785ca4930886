"""KV-cache eviction under a budget: StreamingLLM, H2O, SnapKV and PyramidKV (lecture 2-4).

Each method answers one question -- which `budget` of the prompt's T cached tokens to keep -- and the answer
is a *keep-set* of token indices. The four pure keep-set functions below are the course exercises:

- `streaming_keep`  StreamingLLM (Xiao et al., 2023): the first `num_sink` tokens (attention sinks) + the most
  recent ones. Fixed rule, same for every head and layer, needs no scores.
- `h2o_keep`        H2O (Zhang et al., 2023): a recent window + the "heavy hitters", the tokens with the largest
  attention accumulated over all queries so far; per head.
- `snapkv_keep`     SnapKV (Li et al., 2024): only the last `window` queries (the observation window, e.g. the
  question) vote; their attention is pooled along tokens so neighbours of a hit survive too; per KV head.
- `pyramid_budgets` PyramidKV (Cai et al., 2024): SnapKV's selection, but lower layers get larger budgets.

`compress_prefill` applies them to a Hugging Face Llama model (SmolLM2) the way NVIDIA kvpress does: forward
hooks on every attention module run during the prefill, score with that layer's queries and the keys just
written to the `DynamicCache`, and replace `cache.layers[i].keys / values` with the kept rows. `greedy_continue`
then decodes from the pruned cache with explicit `position_ids`, so RoPE keeps the *original* positions
(the cache is shorter than the text it stands for; the causal mask is sized from the cache, RoPE from the ids).

Why the HF cache and not the engine's paged cache? H2O, SnapKV and PyramidKV keep a different token set per
head and (PyramidKV) a different number of tokens per layer, and they need attention weights the engine's
fused attention never materialises. The paged cache has one block table per sequence shared by all heads and
layers, so per-head sets would need per-head block tables and kernels. Only StreamingLLM's rule (same set
everywhere, whole blocks can be dropped) fits the paged layout; it belongs in the engine, block-granular.
"""
from __future__ import annotations

import inspect
import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F

__all__ = ["streaming_keep", "h2o_keep", "snapkv_keep", "pyramid_budgets", "METHODS", "compress_prefill",
           "greedy_continue", "generate_compressed", "continuation_nll", "cache_kwarg"]

METHODS = ("full", "streaming", "h2o", "snapkv", "pyramidkv")


def _check_budget(seq_len: int, budget: int, always_kept: int, what: str) -> None:
    """Every method keeps some tokens unconditionally (`always_kept`); the budget must cover them."""
    if seq_len < 1 or always_kept < 0:
        raise ValueError(f"need seq_len >= 1 and {what} >= 0, got {seq_len} and {always_kept}")
    if budget < max(always_kept, 1):
        raise ValueError(f"budget {budget} is below {what} ({always_kept}): raise the budget or shrink {what}")


def streaming_keep(seq_len: int, budget: int, num_sink: int = 4) -> torch.LongTensor:
    """StreamingLLM keep-set: tokens `0..num_sink-1` plus the last `budget - num_sink` tokens.

    Returns sorted indices `[min(budget, seq_len)]`; all of `0..seq_len-1` when the budget covers them.
    """
    _check_budget(seq_len, budget, num_sink + 1, "num_sink + 1")
    if budget >= seq_len:
        return torch.arange(seq_len)
    return torch.cat([torch.arange(num_sink), torch.arange(seq_len - (budget - num_sink), seq_len)])


def _top_plus_recent(scores: torch.Tensor, budget: int, recent: int) -> torch.LongTensor:
    """Per row of `scores` [H, T]: the last `recent` indices + the `budget - recent` best-scoring earlier ones, sorted."""
    H, T = scores.shape
    if budget >= T:
        return torch.arange(T).expand(H, T).clone()
    top = scores[:, : T - recent].topk(budget - recent, dim=-1).indices                 # [H, budget - recent]
    tail = torch.arange(T - recent, T).expand(H, recent)
    return torch.cat([top, tail], dim=-1).sort(dim=-1).values


def h2o_keep(attn_scores_acc: torch.Tensor, budget: int, recent: int) -> torch.LongTensor:
    """H2O keep-set per head: the `recent` most recent tokens plus the `budget - recent` heavy hitters.

    `attn_scores_acc` [H, T]: attention each token has received, summed over all queries so far (its column sum
    of the causal attention matrix). Returns sorted indices [H, min(budget, T)].
    """
    if attn_scores_acc.dim() != 2:
        raise ValueError(f"attn_scores_acc must be [H, T], got shape {tuple(attn_scores_acc.shape)}")
    _check_budget(attn_scores_acc.shape[1], budget, recent, "recent")
    return _top_plus_recent(attn_scores_acc, budget, recent)


def snapkv_scores(q_obs: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Attention the observation window's queries give each key, averaged over the window and over the query
    heads that share a KV head (GQA). `q_obs` [H, W, D] (after RoPE; they are the last W tokens), `k` [Hkv, T, D].
    Returns [Hkv, T]; the softmax runs over all T keys with the causal mask inside the window."""
    H, W, D = q_obs.shape
    Hkv, T, _ = k.shape
    k_rep = k.repeat_interleave(H // Hkv, dim=0)                                        # [H, T, D]
    logits = q_obs @ k_rep.transpose(1, 2) / math.sqrt(D)                               # [H, W, T]
    future = torch.arange(T)[None, :] > torch.arange(T - W, T)[:, None]                 # [W, T] key after query
    probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
    return probs.mean(dim=1).view(Hkv, H // Hkv, T).mean(dim=1)


def snapkv_keep(q_obs: torch.Tensor, k: torch.Tensor, budget: int, window: int, kernel_size: int = 7,
                pooling: str = "max") -> torch.LongTensor:
    """SnapKV keep-set per KV head: the last `window` tokens (the observation window, always kept) plus the
    `budget - window` earlier tokens with the highest window votes, the votes first pooled along tokens with a
    `kernel_size` max (or avg) filter (stride 1, zero padding `kernel_size // 2`) so a hit keeps its neighbours.

    `q_obs` [H, window, D]: the window's queries after RoPE; `k` [Hkv, T, D]: the layer's cached keys.
    Returns sorted indices [Hkv, min(budget, T)].
    """
    if q_obs.dim() != 3 or k.dim() != 3 or q_obs.shape[2] != k.shape[2] or q_obs.shape[0] % k.shape[0]:
        raise ValueError(f"need q_obs [H, W, D] and k [Hkv, T, D] with H a multiple of Hkv, got "
                         f"{tuple(q_obs.shape)} and {tuple(k.shape)}")
    if q_obs.shape[1] != window or not 1 <= window <= k.shape[1]:
        raise ValueError(f"q_obs holds {q_obs.shape[1]} queries but window={window} (T={k.shape[1]}): pass the "
                         f"last `window` queries")
    if kernel_size % 2 == 0 or pooling not in ("max", "avg"):
        raise ValueError(f"kernel_size must be odd (got {kernel_size}) and pooling 'max' or 'avg' (got {pooling!r})")
    _check_budget(k.shape[1], budget, window, "window")
    votes = snapkv_scores(q_obs, k)                                                     # [Hkv, T]
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    pooled = pool(votes[None], kernel_size, stride=1, padding=kernel_size // 2)[0]
    return _top_plus_recent(pooled, budget, window)


def pyramid_budgets(num_layers: int, total_budget: int, beta: float = 20, max_per_layer: int | None = None) -> list[int]:
    """PyramidKV's per-layer budgets: an arithmetic sequence decreasing with depth that sums to `total_budget`.

    PyramidKV (Cai et al., 2024, arXiv:2406.02069, Sec. 3.3): with the average budget k = total / L, the top
    layer gets k / beta, the bottom layer 2k - k / beta, and layer l the linear interpolation
    b_l = b_0 - l (b_0 - b_{L-1}) / (L - 1). If `max_per_layer` (the prompt length) is below b_0, the bottom
    layer is capped there and the top raised so the sum still holds, as in the authors' code. Rounded to
    integers by largest remainder: still non-increasing, and the sum is exactly `total_budget`.
    """
    if num_layers < 1 or total_budget < num_layers or beta < 1:
        raise ValueError(f"need num_layers >= 1, total_budget >= num_layers and beta >= 1, got "
                         f"{num_layers}, {total_budget}, {beta}")
    if num_layers == 1:
        return [total_budget]
    avg = total_budget / num_layers
    if max_per_layer is not None and avg > max_per_layer:
        raise ValueError(f"total_budget {total_budget} over {num_layers} layers exceeds max_per_layer {max_per_layer}")
    lo = avg / beta
    hi = 2 * avg - lo
    if max_per_layer is not None and hi > max_per_layer:
        hi, lo = max_per_layer, 2 * avg - max_per_layer
    step = (hi - lo) / (num_layers - 1)
    exact = [hi - l * step for l in range(num_layers)]
    out = [math.floor(x) for x in exact]
    order = sorted(range(num_layers), key=lambda l: (-(exact[l] - out[l]), l))
    for l in order[: total_budget - sum(out)]:
        out[l] += 1
    return out


# ----------------------------------------------------------------------------------------------------------
# Applying a keep-set to a Hugging Face model's DynamicCache (the kvpress way: hooks during prefill).

def cache_kwarg(model) -> str:
    """transformers 5.x renamed `past_key_values` to `cache` in forward(); use whichever this version takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _queries(module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n: int) -> torch.Tensor:
    """The layer's last `n` queries after RoPE, recomputed from its input: [H, n, D] (batch 1)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q = module.q_proj(hidden[:, -n:]).view(1, n, -1, module.head_dim).transpose(1, 2)   # [1, H, n, D]
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -n:], sin[:, -n:])
    return q[0]


def _keep_for_layer(method: str, module, hidden, cos, sin, keys, budget: int, window: int, num_sink: int,
                    kernel_size: int, pooling: str) -> torch.LongTensor:
    """Keep-set [Hkv, budget] for one layer; `keys` [Hkv, T, D] are the rotated keys just cached."""
    Hkv, T, _ = keys.shape
    if method == "streaming":
        return streaming_keep(T, budget, num_sink).expand(Hkv, -1)
    if method == "h2o":   # column sums of the full causal attention of the prompt, GQA heads averaged
        q = _queries(module, hidden, cos, sin, T)                                       # [H, T, D]
        acc = snapkv_scores(q, keys) * T                                                # mean over T queries -> sum
        return h2o_keep(acc, budget, window)
    q_obs = _queries(module, hidden, cos, sin, window)
    return snapkv_keep(q_obs, keys, budget, window, kernel_size, pooling)


@contextmanager
def _pruning_hooks(model, cache, budgets: list[int], method: str, **kw):
    """Forward hooks that prune `cache.layers[i]` to `budgets[i]` tokens right after layer i's attention ran."""
    def hook(module, args, kwargs, output):
        i = module.layer_idx
        layer = cache.layers[i]
        cos, sin = kwargs["position_embeddings"]
        keep = _keep_for_layer(method, module, kwargs["hidden_states"], cos, sin, layer.keys[0], budgets[i], **kw)
        idx = keep[None, :, :, None].expand(-1, -1, -1, layer.keys.shape[-1])           # [1, Hkv, budget, D]
        layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
        return output

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def compress_prefill(model, input_ids: torch.Tensor, method: str, budget: int, window: int = 16, num_sink: int = 4,
                     kernel_size: int = 7, pooling: str = "max", beta: float = 20):
    """Prefill `input_ids` [1, T] and prune the cache to `budget` tokens per layer and KV head (PyramidKV: an
    average of `budget`, decreasing with depth). `window`: SnapKV/PyramidKV observation window and H2O's recent
    window, always kept. Returns `(cache, last_logits [vocab])`; continue with `greedy_continue(..., start_position=T)`.
    """
    from transformers import DynamicCache

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T] (one prompt), got shape {tuple(input_ids.shape)}")
    T, L = input_ids.shape[1], model.config.num_hidden_layers
    cache = DynamicCache(config=model.config)
    if method == "full":   # budget >= T still runs the hooks: the keep-sets are then everything, a no-op gather
        budgets = None
    elif method == "pyramidkv":
        if budget <= window:
            raise ValueError(f"pyramidkv needs budget > window ({budget} <= {window}): raise budget or shrink window")
        extra = min(budget, T) - window
        budgets = [window + b for b in pyramid_budgets(L, L * extra, beta, max_per_layer=T - window)]
    else:
        budgets = [budget] * L
    run = lambda: model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    if budgets is None:
        out = run()
    else:
        with _pruning_hooks(model, cache, budgets, "snapkv" if method == "pyramidkv" else method, window=window,
                            num_sink=num_sink, kernel_size=kernel_size, pooling=pooling):
            out = run()
    return cache, out.logits[0, -1]


def _uneven(model, cache) -> bool:
    """True when the cache's layers hold different lengths (PyramidKV); such a cache is fed one token at a time."""
    lengths = {cache.get_seq_length(i) for i in range(len(cache.layers))}
    if len(lengths) > 1 and model.config._attn_implementation != "sdpa":
        raise ValueError(f"the cache's layers hold different lengths {sorted(lengths)} (PyramidKV): decoding needs "
                         f"attn_implementation='sdpa', which builds no mask for one-token queries; call "
                         f"model.set_attn_implementation('sdpa') (now {model.config._attn_implementation!r})")
    return len(lengths) > 1


@torch.no_grad()
def greedy_continue(model, cache, input_ids: torch.Tensor, start_position: int, max_new_tokens: int,
                    eos_token_id: int | None = None) -> list[int]:
    """Feed `input_ids` [1, n] (their original positions start at `start_position`) into a (pruned) cache and
    decode greedily. Returns the `max_new_tokens` new ids (fewer at EOS).

    Positions are passed explicitly: the cache holds fewer rows than the text it stands for, and RoPE must see
    the token's true position. When layers hold different lengths (PyramidKV) the causal mask, sized from layer 0,
    would be wrong for a multi-token input, so the input is then fed one token at a time, and only SDPA works
    (eager attention adds the layer-0-sized mask even for one query; SDPA skips it).
    """
    kw = cache_kwarg(model)
    chunks = list(input_ids.split(1, dim=1)) if _uneven(model, cache) else [input_ids]
    pos = start_position
    for chunk in chunks:
        position_ids = torch.arange(pos, pos + chunk.shape[1])[None]
        logits = model(input_ids=chunk, position_ids=position_ids, use_cache=True, logits_to_keep=1, **{kw: cache}).logits
        pos += chunk.shape[1]
    out: list[int] = []
    while len(out) < max_new_tokens:
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt == eos_token_id or len(out) == max_new_tokens:
            break
        logits = model(input_ids=torch.tensor([[nxt]]), position_ids=torch.tensor([[pos]]), use_cache=True,
                       logits_to_keep=1, **{kw: cache}).logits
        pos += 1
    return out


def generate_compressed(model, context_ids: torch.Tensor, question_ids: torch.Tensor, method: str, budget: int,
                        question_aware: bool = True, max_new_tokens: int = 8, eos_token_id: int | None = None,
                        **kw) -> list[int]:
    """Answer `question_ids` [1, q] about `context_ids` [1, c] from a cache compressed to `budget` tokens per layer.

    question_aware=True: compress context + question together, so the question sits in the observation window
    (SnapKV's setting). False: compress the context alone, then append the question uncompressed (kvpress's
    question-agnostic setting: the cache could serve any later question).
    """
    if question_aware:
        ids = torch.cat([context_ids, question_ids], dim=1)
        cache, logits = compress_prefill(model, ids, method, budget, **kw)
        first = int(logits.argmax())
        if max_new_tokens == 1 or first == eos_token_id:
            return [first]
        return [first] + greedy_continue(model, cache, torch.tensor([[first]]), ids.shape[1], max_new_tokens - 1,
                                         eos_token_id)
    cache, _ = compress_prefill(model, context_ids, method, budget, **kw)
    return greedy_continue(model, cache, question_ids, context_ids.shape[1], max_new_tokens, eos_token_id)


@torch.no_grad()
def continuation_nll(model, cache, last_logits: torch.Tensor, cont_ids: torch.Tensor, start_position: int) -> tuple[float, int]:
    """Teacher-forced negative log-likelihood (natural log, summed) of `cont_ids` [1, n] following a (compressed)
    context cache: token 0 is scored by the context's `last_logits` [vocab], tokens 1..n-1 by feeding the
    continuation at its original positions `start_position..`. Returns (nll_sum, n). Perplexity over several
    windows: exp(sum of nll_sum / sum of n). A cache whose layers hold different lengths (PyramidKV) is fed
    one token at a time (see `greedy_continue`)."""
    kw = cache_kwarg(model)
    n = cont_ids.shape[1]
    nll = F.cross_entropy(last_logits.float()[None], cont_ids[0, :1], reduction="sum").item()
    if n == 1:
        return nll, 1
    feed = cont_ids[:, :-1]
    chunks = list(feed.split(1, dim=1)) if _uneven(model, cache) else [feed]
    pos, logits = start_position, []
    for chunk in chunks:
        position_ids = torch.arange(pos, pos + chunk.shape[1])[None]
        logits.append(model(input_ids=chunk, position_ids=position_ids, use_cache=True, **{kw: cache}).logits[0])
        pos += chunk.shape[1]
    nll += F.cross_entropy(torch.cat(logits).float(), cont_ids[0, 1:], reduction="sum").item()
    return nll, n
