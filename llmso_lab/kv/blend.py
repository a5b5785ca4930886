"""Cache blending for RAG (lecture 2-4; CacheBlend, Yao et al., EuroSys 2025, arXiv:2405.16444).

A RAG prompt is [shared prefix][chunk 1]...[chunk N][question], and the retrieved chunks change from request to
request, so prefix caching rarely hits past the first chunk. The idea: precompute each chunk's KV once, alone,
and concatenate the stored KVs for any combination. Two things go wrong:

1. Positions. RoPE rotates each key by its position. We prefill every chunk alone at positions 0..n-1 (so one
   stored copy serves the chunk wherever it lands) and `rerotate_keys` turns a key rotated for position p into
   the key for p + delta: rotations compose, R(p + delta) = R(delta) R(p). V carries no position. Attention
   scores under RoPE depend only on relative positions, so a chunk shifted as a whole computes the same hidden
   states: re-rotated, its stored KV equals the KV of the chunk prefilled alone at its final place, in every
   layer (up to float rounding). In layer 0 it equals the full prefill's too (K, V depend on token and position).
2. Cross-attention. From layer 1 on, a chunk token's KV depends on the tokens before it, and a chunk prefilled
   alone never saw the chunks before it. The per-token deviation from a full prefill (`kv_deviation`, relative
   L2) grows with depth and is concentrated on a few tokens.

CacheBlend recomputes the KV of the few tokens that deviate most ("high-KV-deviation" tokens) and keeps the
stored KV for the rest. `blend` does it layer by layer on a Hugging Face Llama model (SmolLM2):

  layers < select_layer  every chunk and question token is computed (layer 0: needed to know the layer-1 input)
  select_layer (1)       the K and V of every chunk token are projected from its true hidden state and compared
                         with the stored (re-rotated) ones; the `ratio` most deviating chunk tokens are selected
  later layers           only the selected tokens and the question run: their new K and V overwrite the stored
                         rows, and their queries attend over the blended cache (stored + recomputed rows)

ratio = 0 is plain concatenation (only the question is computed); ratio = 1 is exactly a full prefill.
What we simplify: CacheBlend narrows the selection gradually over the first layers and pipelines recomputation
with loading KV from storage; we select once, on one layer, by V deviation (or K), on one prompt at a time.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmso_lab.kv.evict import cache_kwarg, greedy_continue
from llmso_lab.kv.needle import Needle, make_needle
from llmso_lab.models.shapes import ModelShape

__all__ = ["rerotate_keys", "kv_deviation", "select_tokens", "select_high_deviation", "prefill_kv", "BlendResult",
           "blend", "full_prefill", "deviation_by_layer", "greedy_answer", "PREFIX", "rag_prompt", "run_selector"]


# ---- the pure pieces ---------------------------------------------------------------------------------------------
def rerotate_keys(keys: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move RoPE-rotated keys `delta` positions on: keys [..., T, D] rotated for positions p give those for p + delta.

    `inv_freq` [D / 2]: the model's RoPE frequencies (`model.model.rotary_emb.inv_freq`); the halves layout of
    Hugging Face Llama (`rotate_half`: dimension i pairs with i + D/2). `delta`: an int or one per token [T].
    """
    D = keys.shape[-1]
    if inv_freq.shape != (D // 2,):
        raise ValueError(f"inv_freq must have head_dim / 2 = {D // 2} entries, got shape {tuple(inv_freq.shape)}")
    delta = torch.as_tensor(delta, dtype=torch.float32).reshape(-1, 1)                 # [T or 1, 1]
    angle = torch.cat([delta * inv_freq.float()] * 2, dim=-1)                          # [T or 1, D]
    cos, sin = angle.cos().to(keys.dtype), angle.sin().to(keys.dtype)
    k1, k2 = keys[..., : D // 2], keys[..., D // 2:]
    return keys * cos + torch.cat([-k2, k1], dim=-1) * sin


def kv_deviation(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per-token relative L2 deviation ||new - old|| / ||new|| over heads and dims: [B, H, T, D] -> [T] (B = 1)."""
    if new.shape != old.shape or new.dim() != 4 or new.shape[0] != 1:
        raise ValueError(f"need two [1, H, T, D] tensors of one shape, got {tuple(new.shape)} and {tuple(old.shape)}")
    diff = (new - old).float().pow(2).sum(dim=(0, 1, 3)).sqrt()
    return diff / new.float().pow(2).sum(dim=(0, 1, 3)).sqrt().clamp_min(1e-12)


def select_tokens(deviation: torch.Tensor, ratio: float) -> torch.LongTensor:
    """Indices (sorted) of the round(ratio x T) tokens with the largest `deviation` [T]; ties go to the earlier."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1] (a fraction of the chunk tokens), got {ratio}")
    k = int(ratio * deviation.numel() + 0.5)
    order = sorted(range(deviation.numel()), key=lambda t: (-float(deviation[t]), t))
    return torch.tensor(sorted(order[:k]), dtype=torch.long)


def select_high_deviation(new: torch.Tensor, old: torch.Tensor, ratio: float) -> torch.LongTensor:
    """CacheBlend's selection: of the chunk tokens whose true K or V `new` [1, H, T, D] and stored `old` are given,
    the round(ratio x T) with the largest relative deviation ||new - old|| / ||new|| (over heads and dims), as sorted
    indices into 0..T-1 (ties: the earlier token)."""
    return select_tokens(kv_deviation(new, old), ratio)


# ---- on the model ------------------------------------------------------------------------------------------------
def _check_ids(name: str, ids: torch.Tensor, allow_empty: bool = True) -> None:
    if ids.dim() != 2 or ids.shape[0] != 1 or (ids.shape[1] == 0 and not allow_empty):
        raise ValueError(f"{name} must be [1, n] token ids{'' if allow_empty else ' with n >= 1'}, "
                         f"got shape {tuple(ids.shape)}")


@torch.no_grad()
def prefill_kv(model, ids: torch.Tensor, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) per layer, each [1, Hkv, n, D], of `ids` [1, n] prefilled alone at positions start..start+n-1."""
    _check_ids("ids", ids)
    if ids.shape[1] == 0:
        a = model.model.layers[0].self_attn
        empty = torch.zeros(1, model.config.num_key_value_heads, 0, a.head_dim, dtype=model.dtype)
        return [(empty, empty)] * model.config.num_hidden_layers
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=ids, position_ids=torch.arange(start, start + ids.shape[1])[None], use_cache=True,
          logits_to_keep=1, **{cache_kwarg(model): cache})
    return [(layer.keys, layer.values) for layer in cache.layers]


@torch.no_grad()
def full_prefill(model, ids: torch.Tensor):
    """The reference: one ordinary prefill of the whole prompt. Returns (DynamicCache, last-token logits [vocab])."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    return cache, out.logits[0, -1]


@dataclass
class BlendResult:
    cache: object                  # DynamicCache over the whole prompt (blended rows + recomputed rows)
    logits: torch.Tensor           # [vocab] at the last prompt token
    selected: torch.LongTensor     # prompt positions of the chunk tokens recomputed after select_layer
    num_chunk_tokens: int
    flops: float                   # what blending computed (prefix and stored chunks not counted)
    full_flops: float              # a prefill of chunks + question behind the cached prefix

    @property
    def recompute_fraction(self) -> float:
        return self.selected.numel() / max(self.num_chunk_tokens, 1)


def _layer_flops(shape: ModelShape, full_positions: torch.Tensor, kv_only: int = 0) -> float:
    """FLOPs of one layer for tokens at `full_positions` (projections, MLP, attention over all earlier tokens)
    plus `kv_only` tokens that only get their K and V projected."""
    L = shape.num_layers
    pairs = int((full_positions + 1).sum())
    kv = 2 * 2 * shape.hidden_size * shape.num_kv_heads * shape.head_dim
    return 2 * shape.body_matmul_params() / L * full_positions.numel() + shape.attention_flops(1) / L * pairs + kv * kv_only


@torch.no_grad()
def blend(model, prefix_ids: torch.Tensor, chunk_ids: list[torch.Tensor], question_ids: torch.Tensor,
          ratio: float, chunk_kv: list | None = None, select_layer: int = 1, on: str = "v",
          select: str = "deviation", seed: int = 0, selector=None) -> BlendResult:
    """Prefill [prefix][chunks][question] from stored chunk KVs, recomputing the `ratio` most deviating chunk
    tokens (module docstring). `chunk_kv[i]`: `prefill_kv(model, chunk_ids[i])` (computed here when None), stored
    at positions 0..n-1 and re-rotated into place. The prefix (a shared system prompt: ordinary prefix caching) is
    exact. `on`: select by the deviation of "v" (CacheBlend's choice) or "k". `select="random"`: the same number
    of chunk tokens drawn at random (seeded), the control showing that choosing by deviation is what helps.
    `selector(new, old, ratio)`: the selection itself (default `select_high_deviation`; Lab 10's exercise plugs in
    the student's), given the select layer's true and stored K or V rows of the chunk tokens [1, H, n, D]."""
    _check_ids("prefix_ids", prefix_ids)
    _check_ids("question_ids", question_ids, allow_empty=False)
    for c in chunk_ids:
        _check_ids("each chunk", c, allow_empty=False)
    L = model.config.num_hidden_layers
    if select not in ("deviation", "random"):
        raise ValueError(f"select must be 'deviation' or 'random', got {select!r}")
    if not 0 <= select_layer < L or on not in ("k", "v"):
        raise ValueError(f"need 0 <= select_layer < {L} (1 is CacheBlend's) and on in ('k', 'v'), got "
                         f"{select_layer}, {on!r}")
    m = model.model
    chunk_kv = chunk_kv if chunk_kv is not None else [prefill_kv(model, c) for c in chunk_ids]
    ids = torch.cat([prefix_ids, *chunk_ids, question_ids], dim=1)
    T, p, q = ids.shape[1], prefix_ids.shape[1], question_ids.shape[1]
    # the blended cache: exact prefix, stored chunks re-rotated to their offsets, empty question rows
    starts = torch.tensor([0] + [c.shape[1] for c in chunk_ids]).cumsum(0)[:-1] + p
    pre = prefill_kv(model, prefix_ids)
    K, V = [], []
    for l in range(L):
        ks = [rerotate_keys(kv[l][0], int(s), m.rotary_emb.inv_freq) for kv, s in zip(chunk_kv, starts)]
        pad = torch.zeros(1, pre[l][0].shape[1], q, pre[l][0].shape[3], dtype=pre[l][0].dtype)
        K.append(torch.cat([pre[l][0], *ks, pad], dim=2).clone())
        V.append(torch.cat([pre[l][1], *(kv[l][1] for kv in chunk_kv), pad], dim=2).clone())

    shape = ModelShape.from_hf_config(model.config)
    active = torch.arange(p, T)                                  # prompt positions computed in this layer
    cos, sin = m.rotary_emb(K[0], torch.arange(T)[None])         # [1, T, D]
    h = m.embed_tokens(ids[:, active])                           # [1, n, hidden]
    flops, chunk_end, selected = 0.0, T - q, torch.arange(p, T - q)
    for l, layer in enumerate(m.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        heads = lambda proj: proj(x).view(1, x.shape[1], -1, a.head_dim).transpose(1, 2)
        qs, ks, vs = heads(a.q_proj), heads(a.k_proj), heads(a.v_proj)      # [1, H or Hkv, n, D]
        c, s = cos[:, active][:, None], sin[:, active][:, None]
        rot = lambda t: t * c + torch.cat([-t[..., a.head_dim // 2:], t[..., : a.head_dim // 2]], dim=-1) * s
        qs, ks = rot(qs), rot(ks)
        if l == select_layer:                                    # pick the high-deviation chunk tokens
            in_chunk = active < chunk_end
            new, old = (vs, V[l]) if on == "v" else (ks, K[l])
            if select == "random":
                n_chunk = int(in_chunk.sum())
                chosen = select_tokens(torch.rand(n_chunk, generator=torch.Generator().manual_seed(seed)), ratio)
            else:
                chosen = (selector or select_high_deviation)(new[:, :, in_chunk], old[:, :, active[in_chunk]], ratio)
                chosen = torch.as_tensor(chosen, dtype=torch.long).reshape(-1)
            keep = torch.cat([chosen, (~in_chunk).nonzero()[:, 0]])
            flops += _layer_flops(shape, torch.empty(0), kv_only=len(active) - len(keep))
            selected = active[keep[: len(keep) - q]]
            active, h, qs, ks, vs = active[keep], h[:, keep], qs[:, :, keep], ks[:, :, keep], vs[:, :, keep]
        K[l][:, :, active], V[l][:, :, active] = ks, vs
        mask = active[:, None] >= torch.arange(T)[None]          # [n, T]: causal over the whole prompt
        o = F.scaled_dot_product_attention(qs, K[l], V[l], attn_mask=mask, scale=a.scaling, enable_gqa=True)
        h = h + a.o_proj(o.transpose(1, 2).reshape(1, len(active), -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        flops += _layer_flops(shape, active)
    logits = model.lm_head(m.norm(h[:, -1:]))[0, -1]

    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    for l in range(L):
        cache.update(K[l], V[l], l)
    full = L * _layer_flops(shape, torch.arange(p, T))
    return BlendResult(cache, logits, selected, chunk_end - p, flops, full)


def deviation_by_layer(full_cache, blended_cache, start: int, end: int, on: str = "v") -> torch.Tensor:
    """[L, end - start]: `kv_deviation` of each layer's K or V rows start..end-1 between two caches."""
    pick = (lambda layer: layer.values) if on == "v" else (lambda layer: layer.keys)
    return torch.stack([kv_deviation(pick(f)[:, :, start:end], pick(b)[:, :, start:end])
                        for f, b in zip(full_cache.layers, blended_cache.layers)])


def greedy_answer(model, cache, logits: torch.Tensor, prompt_len: int, max_new_tokens: int = 8,
                  eos_token_id: int | None = None) -> list[int]:
    """Greedy answer from a prefilled prompt (`blend`'s or `full_prefill`'s cache and last logits): the first
    token from `logits`, the rest decoded from the cache (`kv.evict.greedy_continue`, which extends it)."""
    first = int(logits.argmax())
    if max_new_tokens == 1 or first == eos_token_id:
        return [first]
    return [first] + greedy_continue(model, cache, torch.tensor([[first]]), prompt_len, max_new_tokens - 1,
                                     eos_token_id)


# ---- a small RAG task from the project's own data ------------------------------------------------------------------
PREFIX = "Read the documents below, then answer the question.\n\n"


def rag_prompt(tokenizer, num_tokens: int = 512, depth: float = 0.5, num_chunks: int = 4, seed: int = 0
               ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, Needle]:
    """(prefix_ids, chunk_ids, question_ids, needle): `kv.needle.make_needle`'s haystack (the secret code at
    `depth`) cut at sentence ends into `num_chunks` chunks of about equal length, each tokenized on its own (as a
    retriever's chunks would be stored), behind the shared instruction `PREFIX`, and the needle's question."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    needle = make_needle(tokenizer, num_tokens, depth, seed)
    sents = re.split(r"(?<=[.!?])\s+", needle.context)
    if len(sents) < num_chunks:
        raise ValueError(f"the haystack has {len(sents)} sentences, fewer than num_chunks={num_chunks}: raise num_tokens")
    bounds = [round(i * len(sents) / num_chunks) for i in range(num_chunks + 1)]
    enc = lambda text: torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    chunks = [enc((" " if i else "") + " ".join(sents[a:b])) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return enc(PREFIX), chunks, enc(needle.question), needle


def run_selector(selector, ratio: float, seed: int = 0, chunk_lens: tuple[int, ...] = (20, 14, 17), prefix_len: int = 4,
                 question_len: int = 5, on: str = "v", answer_tokens: int = 4) -> dict:
    """Lab 10's harness for the CacheBlend selection exercise: `blend` runs with `selector(new, old, ratio)` choosing
    the chunk tokens to recompute (new, old: the select layer's true and stored V (or K) rows of the chunk tokens,
    [1, Hkv, n, D]; it returns their indices 0..n-1). The model is a tiny seeded Llama (`models.tiny.tiny_llama`, 4
    layers, fp32); prefix, chunks and question are random token ids from `seed`, each chunk prefilled alone.

    Returns plain data: "selected" (prompt positions recomputed), "answer" (greedy tokens from the blended cache),
    "same_answer_as_full" (equal to a full prefill's), "deviation_x1000" (mean last-layer V deviation from the
    full prefill over the chunk tokens, x1000, rounded: how much of the full-prefill KV the selection recovered)."""
    from llmso_lab.models.tiny import tiny_llama

    model = tiny_llama(num_layers=4, max_position_embeddings=512, seed=1)
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, model.config.vocab_size, (1, n), generator=g)   # noqa: E731
    pre, chunks, q = ids(prefix_len), [ids(n) for n in chunk_lens], ids(question_len)
    b = blend(model, pre, chunks, q, ratio, on=on, selector=selector)
    T = pre.shape[1] + sum(chunk_lens) + question_len
    full_cache, full_logits = full_prefill(model, torch.cat([pre, *chunks, q], 1))
    answer = greedy_answer(model, b.cache, b.logits, T, answer_tokens)
    full = greedy_answer(model, full_cache, full_logits, T, answer_tokens)
    # the last layer's V deviation from the full prefill, written out here: `kv_deviation` is disabled while graded
    full_v = full_cache.layers[-1].values[:, :, prefix_len:T - question_len].float()
    diff = (full_v - b.cache.layers[-1].values[:, :, prefix_len:T - question_len].float()).pow(2).sum(dim=(0, 1, 3))
    dev = (diff.sqrt() / full_v.pow(2).sum(dim=(0, 1, 3)).sqrt().clamp_min(1e-12)).mean()
    return {"selected": b.selected.tolist(), "answer": answer, "same_answer_as_full": answer == full,
            "deviation_x1000": round(float(dev) * 1000)}
