"""Attention backends over the paged KV cache, for one flattened varlen batch of prefills and decodes.

A backend does `plan(metadata)` once per step (per-step precomputation shared by the layers), then two
things per layer:
- `store_kvcache(k, v, k_cache, v_cache, slot_mapping)`: write this step's new K/V into their cache slots;
- `forward(q, k, v, k_cache, v_cache, metadata, sliding_window)`: attention of every query token over
  its own sequence's cached keys (causal). `k`, `v` are this step's new keys/values as well, so that a
  prefill with nothing cached can run a varlen flash-attention kernel on them directly.

The batch holds `num_decodes` decode sequences (one query token each) first, then prefill sequences
(a whole prompt or a chunk of it, possibly after cached tokens). Static batching adds padding tokens after
a row's real tokens; they write to the null slot and their outputs are discarded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from llmso_lab.engine.decode_groups import GROUP_COST_BLOCKS, DecodeGroup, plan_decode_groups
from llmso_lab.engine.kv_cache import LayerKV

ATTENTION_BACKENDS = ("torch", "triton")


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: Tensor     # [T] int64: cache slot (block * block_size + offset) of each token; null slot for padding
    block_tables: Tensor     # [B, max_blocks] int32, padded with the null block
    context_lens: Tensor     # [B] int32: keys in the cache for each sequence after this step's writes
    cu_seqlens_q: Tensor     # [B + 1] int32: offsets of each sequence's query tokens (incl. padding) in T
    cu_seqlens_k: Tensor     # [B + 1] int32: cumulative context_lens
    num_decodes: int         # the first num_decodes sequences have one query token each
    max_seqlen_q: int
    max_seqlen_k: int
    start_positions: list[int]   # [B] position of each sequence's first query token (= tokens cached before)
    query_lens: list[int]        # [B] query tokens per sequence, incl. padding (host copy of cu_seqlens_q diff)
    context_lens_host: list[int]  # [B] host copy of context_lens, so the torch backend never syncs


class TorchAttentionBackend:
    """Reference backend: gather each sequence's cached blocks and run SDPA (exact math, fp32 softmax).

    Decode rows are gathered in groups of similar context length (`decode_groups`, a speed-up: a short row
    is not padded to the longest one in the batch); `decode_group_cost = None` gathers all of them as one
    padded group, the plain reference. `plan(meta)` runs once per step, before the layers (FlashInfer's
    plan/run split): the gather indices and masks, the same for every layer, are built on first use and
    reused by the other layers.
    """

    name = "torch"
    decode_group_cost: int | None = GROUP_COST_BLOCKS   # see decode_groups; None: one padded group
    native_decode = None   # the native path's decode attention (`engine.native`, opt-in): read through the tables

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 v_head_dim: int | None = None, scale: float | None = None, latent: bool = False) -> None:
        """`latent` (MLA): the value is the first `v_head_dim` numbers of the key (`v_cache` is a view of
        `k_cache`), so only the key is stored; `scale` then differs from head_dim^-0.5 (see engine.mla)."""
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.v_head_dim, self.latent = v_head_dim or head_dim, latent
        self.block_size, self.scale = block_size, head_dim ** -0.5 if scale is None else scale
        self._memo: dict = {}

    def plan(self, meta: AttentionMetadata) -> None:
        self._memo = {}

    def _cached(self, key, build):
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def store_kvcache(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
        """k, v: [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; slot_mapping [T]. A quantized cache
        (`engine.kv_cache.LayerKV`) compresses them as it stores them."""
        if isinstance(k_cache, LayerKV):
            k_cache.write(slot_mapping, k, v)
            return
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, k)
        if not self.latent:
            v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, v)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                meta: AttentionMetadata, sliding_window: int | None = None) -> Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (already stored) -> out [T, H, D]."""
        nd = meta.num_decodes
        if nd == q.shape[0]:   # a pure decode step
            return self._decode(q, k_cache, v_cache, meta, sliding_window)
        out = q.new_empty((*q.shape[:2], self.v_head_dim))
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, sliding_window)
        s = nd
        for i in range(nd, len(meta.query_lens)):   # prefills: few per step, each a dense block
            e = s + meta.query_lens[i]
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, meta, i, sliding_window)
            s = e
        return out

    def _decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                window: int | None) -> Tensor:
        """Decodes, one query token each: gather + SDPA per group of rows (`_decode_group`), or with the native path
        on, its kernel reading each row's blocks through the block table (no gather, no padding)."""
        B = q.shape[0]
        if self.native_decode is not None and not self.latent and not isinstance(k_cache, LayerKV):
            return self.native_decode(q, k_cache, v_cache, meta.block_tables[:B], meta.context_lens[:B], self.scale,
                                      window or 0)
        groups = self._cached("decode_groups", lambda: plan_decode_groups(
            meta.block_tables[:B], meta.context_lens_host[:B], self.block_size, self.decode_group_cost))
        if len(groups) == 1:
            return self._decode_group(q, k_cache, v_cache, 0, groups[0], window)
        out = q.new_empty((*q.shape[:2], self.v_head_dim))
        for g, group in enumerate(groups):
            o = self._decode_group(q.index_select(0, group.rows), k_cache, v_cache, g, group, window)
            out.index_copy_(0, group.rows, o)
        return out

    def _decode_group(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, g: int, group: DecodeGroup,
                      window: int | None) -> Tensor:
        """q [B, H, D] of the group's rows -> [B, H, D]: their blocks gathered to [B, Hkv, S, D], one SDPA."""
        B, G = q.shape[0], self.num_heads // self.num_kv_heads
        # index_select, not k_cache[tables]: on CPU advanced indexing is ~1000x slower here
        shape = (B, group.S, self.num_kv_heads, -1)
        k = k_cache.index_select(0, group.blocks).view(shape).transpose(1, 2)   # [B, Hkv, S, D]
        v = v_cache.index_select(0, group.blocks).view(shape).transpose(1, 2)   # [B, Hkv, S, Dv]
        mask, keys = self._cached(("decode_mask", g, window),
                                  lambda: self._decode_mask(group.ctx, group.S, window, q.device, q.dtype))
        if keys is not None:   # every sequence has the same context: slice instead of masking
            k, v = k[:, :, keys], v[:, :, keys]
        # GQA without repeating K/V: the G query heads that share a KV head act as G query rows.
        qg = q.reshape(B, self.num_kv_heads, G, self.head_dim)          # [B, Hkv, G, D]
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
        return o.reshape(B, self.num_heads, self.v_head_dim)

    @staticmethod
    def _decode_mask(ctx: list[int], S: int, window: int | None, device: torch.device,
                     dtype: torch.dtype) -> tuple[Tensor | None, slice | None]:
        """Additive mask [B, 1, 1, S] (0 = visible, -inf = hidden) in the queries' dtype (SDPA wants them equal),
        or a key slice when no mask is needed."""
        if min(ctx) == max(ctx):
            return None, slice(max(0, ctx[0] - window) if window else 0, ctx[0])
        key_pos, ctx_t = torch.arange(S, device=device)[None, :], torch.tensor(ctx, device=device)[:, None]
        visible = key_pos < ctx_t
        if window is not None:
            visible &= key_pos > ctx_t - 1 - window
        return torch.zeros(len(ctx), 1, 1, S, device=device, dtype=dtype).masked_fill_(~visible[:, None, None, :], float("-inf")), None

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 meta: AttentionMetadata, i: int, window: int | None) -> Tensor:
        start, ctx, n = meta.start_positions[i], meta.context_lens_host[i], q.shape[0]
        # SDPA gets 4-D [1, heads, n, D] inputs: in 3-D it falls back to its (slower) math kernel
        if start == 0 and window is None:   # nothing cached before: causal attention on the new K/V
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                               is_causal=True, scale=self.scale, enable_gqa=True)
            return o[0].transpose(0, 1)
        index = self._cached(("prefill_index", i), lambda: meta.block_tables[i, :-(-ctx // self.block_size)].long())
        kc = k_cache.index_select(0, index).view(-1, self.num_kv_heads, self.head_dim)[:ctx].transpose(0, 1)  # [Hkv, ctx, D]
        vc = v_cache.index_select(0, index).view(-1, self.num_kv_heads, self.v_head_dim)[:ctx].transpose(0, 1)
        mask = self._cached(("prefill_mask", i, window), lambda: self._prefill_mask(start, n, ctx, window, q.device, q.dtype))
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[None], vc[None], attn_mask=mask, scale=self.scale,
                                           enable_gqa=True)
        return o[0].transpose(0, 1)

    @staticmethod
    def _prefill_mask(start: int, n: int, ctx: int, window: int | None, device: torch.device, dtype: torch.dtype) -> Tensor:
        """Additive mask [n, ctx] in `dtype`: query t (position start + t) sees keys at positions <= start + t.
        Padding queries (past ctx) see every key."""
        q_pos, key_pos = torch.arange(start, start + n, device=device)[:, None], torch.arange(ctx, device=device)[None, :]
        visible = key_pos <= q_pos
        if window is not None:
            visible &= key_pos > q_pos - window
        return torch.zeros(n, ctx, device=device, dtype=dtype).masked_fill_(~visible, float("-inf"))


class TritonAttentionBackend(TorchAttentionBackend):
    """The Triton kernels of `llmso_lab.attention` on the same paged cache (GPU, or CPU under the interpreter).

    - decodes: `paged_decode_attention` reads each sequence's keys through its block table;
    - prefills: `flash_attention` in varlen form — on the new K/V when nothing is cached, or on the
      sequence's gathered cache when a chunk follows cached tokens (bottom-right causal: Nq < Nk).
    - MLA (a latent cache): decodes by `mla_paged_decode_attention`, prefills on the torch path.
    The torch path remains for what the kernels do not cover: sliding windows, and a right-padded static
    row after cached tokens (its padding would shift the bottom-right causal alignment).
    A quantized cache (`kv_cache_dtype`): INT8 decodes dequantize inside the paged kernel (int8 codes and the
    fp16 scale of each (token, head) loaded, multiplied in registers); FP8 and KIVI decodes dequantize the blocks
    the batch reads first (torch) and run the plain kernel on them: simpler, at the cost of writing and reading
    those blocks once more (KIVI's packed 2/4-bit codes and per-channel key grids would need a kernel of their
    own). Prefills read the gathered blocks dequantized, as the torch backend does.
    """

    name = "triton"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from llmso_lab import attention as kernels  # imports triton lazily, on first use

        self._flash, self._paged = kernels.flash_attention, kernels.paged_decode_attention
        self._mla = kernels.mla_paged_decode_attention

    def _decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                window: int | None) -> Tensor:
        if window is not None:
            return super()._decode(q, k_cache, v_cache, meta, window)
        B = q.shape[0]
        if self.latent:   # MLA: one load of each latent tile serves as K and V for every head
            return self._mla(q, k_cache, meta.block_tables[:B], meta.context_lens[:B], self.v_head_dim, self.scale)
        tables = meta.block_tables[:B]
        if isinstance(k_cache, LayerKV):
            if k_cache.format == "int8":   # the kernel loads int8 codes + fp16 scales and dequantizes in registers
                return self._paged(q, k_cache.codes(), v_cache.codes(), tables, meta.context_lens[:B], scale=self.scale,
                                   k_scale=k_cache.scales(), v_scale=v_cache.scales())
            # fp8 / KIVI: dequantize the blocks this batch reads into a small dense cache, run the plain kernel on it
            used, tables = torch.unique(tables, return_inverse=True)
            k_cache, v_cache = k_cache.index_select(0, used), v_cache.index_select(0, used)
            tables = tables.to(torch.int32)
        return self._paged(q, k_cache, v_cache, tables, meta.context_lens[:B], scale=self.scale)

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 meta: AttentionMetadata, i: int, window: int | None) -> Tensor:
        start, ctx, n = meta.start_positions[i], meta.context_lens_host[i], q.shape[0]
        if window is not None or (start > 0 and start + n != ctx) or self.latent:   # (the flash kernel wants Dv = Dk)
            return super()._prefill(q, k, v, k_cache, v_cache, meta, i, window)
        if start > 0:  # a chunk after cached tokens: attend over the sequence's whole cache
            index = meta.block_tables[i, :-(-ctx // self.block_size)].long()
            k = k_cache.index_select(0, index).view(-1, self.num_kv_heads, self.head_dim)[:ctx]  # [ctx, Hkv, D]
            v = v_cache.index_select(0, index).view(-1, self.num_kv_heads, self.head_dim)[:ctx]
        cu_q = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
        o, _ = self._flash(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=n, scale=self.scale)
        return o


def make_attention_backend(name: str, **kwargs) -> TorchAttentionBackend:
    if name == "torch":
        return TorchAttentionBackend(**kwargs)
    if name == "triton":
        return TritonAttentionBackend(**kwargs)
    raise ValueError(f"unknown attention_backend {name!r}; valid: {', '.join(ATTENTION_BACKENDS)}")
