"""The engine's KV stores: what the model runner keeps its paged KV cache in, behind one small interface.

A store holds, for every layer, the cache the attention backends read and write (`layer_caches[i] = (K, V)`),
and moves whole blocks as the scheduler asks: `copy_blocks` (copy-on-write), `swap_out` / `swap_in` (to and from
a host pool, preemption by swap). It also offers `bytes_per_token()` and `fixed_bytes()` (what the cache costs),
`after_step(out)`, `add_per_block` for another per-block tensor that a feature keeps beside the KV (it then moves
with the blocks), `block_listener()` for a store that must hear when the block manager frees or reuses a block, and
`transfer_tensors()` (what a KV transfer ships). Implementations:

- `PagedKVStore`: plain K and V tensors `[num_layers][num_blocks + 1, block_size, Hkv, D]` (the extra last block is
  the null block that padding tokens write to). With `value_dim` (MLA's latent cache) there is one tensor and the
  "V cache" is a view of its first `value_dim` numbers: nothing is stored twice.
- `QuantizedKVStore` (`kv_cache_dtype` other than "auto", lecture 2-4): `llmso_lab.kv.quant.QuantizedPagedKV`'s
  compressed codes + scales, dequantized on read; KIVI seals blocks as they leave the full-precision window.

`make_kv_store(config, ...)` picks one. Glue for the quantized store:
- `LayerKV`: one layer's half (K or V) of the store, passed to the attention backends where a plain cache tensor
  [num_blocks, block_size, Hkv, D] goes for "auto". The backends only gather whole blocks from a cache
  (`index_select(0, blocks)`), so that is all it offers, dequantized; `write` stores a step's K/V compressed.
- `KiviBlockEvents`: the block manager tells the KIVI store when a block's last holder lets go (`released`) and
  when a free block is handed out again (`reused`).

FP8 scales: static, 1.0 by default, as vLLM without a checkpoint's scales (SmolLM2's K/V stay far below e4m3's
448 and e5m2's 57344, and FP8's error is relative, so 1.0 only loses values under FP8's smallest normal number,
2^-6 (e4m3) / 2^-14 (e5m2)). `calculate_kv_scales=True` (vLLM's name) instead sets each layer's scales from
the first forward's K/V (absmax / FP8 max, per tensor or per KV head): tighter, but later values beyond that
range saturate, and the engine's outputs then depend on which requests came first.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from llmso_lab.kv.quant import QuantizedPagedKV

if TYPE_CHECKING:
    from llmso_lab.engine.config import EngineConfig


Mapping = list[tuple[int, int]]


class HostPool:
    """Block moves between the device and a host pool, over `self.pairs` = [(device tensor, host tensor)], each
    [n, blocks, ...]: what both stores do for preemption by swap."""
    pairs: list[tuple[Tensor, Tensor]]
    device: torch.device

    @torch.inference_mode()
    def swap_out(self, mapping: Mapping) -> None:
        """Copy device blocks to the host pool: mapping [(device block, host block)]."""
        if mapping:
            src, dst = (torch.tensor(x) for x in zip(*mapping))
            for cache, pool in self.pairs:
                pool.index_copy_(1, dst, cache.index_select(1, src.to(self.device)).cpu())

    @torch.inference_mode()
    def swap_in(self, mapping: Mapping) -> None:
        """Copy host blocks back to the device: mapping [(host block, device block)]."""
        if mapping:
            src, dst = (torch.tensor(x) for x in zip(*mapping))
            for cache, pool in self.pairs:
                cache.index_copy_(1, dst.to(self.device), pool.index_select(1, src).to(self.device))


class PagedKVStore(HostPool):
    """Plain paged K/V tensors on the device and a host pool of `num_swap_blocks` blocks with the same layout."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_swap_blocks: int, value_dim: int | None = None) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        swap_shape = (num_layers, num_swap_blocks, block_size, num_kv_heads, head_dim)
        self.device, self.num_swap_blocks = device, num_swap_blocks
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.k_swap = torch.zeros(swap_shape, dtype=dtype)   # host memory
        if value_dim is None:
            self.v_cache, self.v_swap = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(swap_shape, dtype=dtype)
            self.pairs = [(self.k_cache, self.k_swap), (self.v_cache, self.v_swap)]
        else:   # a latent cache: V is the first value_dim numbers of K (a view; moved with K)
            self.v_cache, self.v_swap = self.k_cache[..., :value_dim], self.k_swap[..., :value_dim]
            self.pairs = [(self.k_cache, self.k_swap)]
        self.latent = value_dim is not None
        self.layer_caches = list(zip(self.k_cache.unbind(0), self.v_cache.unbind(0)))   # per-layer views, made once

    def bytes_per_token(self) -> float:
        """Device bytes one token's KV takes in this store (every layer; a latent cache: its one tensor)."""
        tensors = [self.k_cache] if self.latent else [self.k_cache, self.v_cache]
        return sum(t.numel() * t.element_size() for t in tensors) / (self.k_cache.shape[1] * self.k_cache.shape[2])

    def fixed_bytes(self) -> int:
        """Bytes that do not grow with the blocks: none in a plain cache."""
        return 0

    def add_per_block(self, tensor: Tensor) -> None:
        """Keep `tensor` [n, num_blocks, block_size, ...] in step with the KV blocks (copied and swapped with them)."""
        self.pairs.append((tensor, torch.zeros((tensor.shape[0], self.num_swap_blocks, *tensor.shape[2:]),
                                               dtype=tensor.dtype)))

    @torch.inference_mode()
    def copy_blocks(self, mapping: Mapping) -> None:
        """Copy-on-write: mapping [(source block, destination block)] on the device."""
        if mapping:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*mapping))
            for cache, _ in self.pairs:
                cache.index_copy_(1, dst, cache.index_select(1, src))

    def after_step(self, out) -> None:
        """After a step: nothing to settle in a plain cache."""

    def block_listener(self):
        return None

    def transfer_tensors(self) -> list[Tensor]:
        """The per-layer cache tensors a KV transfer carries: K and V, or the one latent cache."""
        return [self.k_cache] if self.latent else [self.k_cache, self.v_cache]


class QuantizedKVStore(QuantizedPagedKV, HostPool):
    """A `QuantizedPagedKV` with the store interface: the backends get per-layer `LayerKV` objects, copy-on-write and
    swapping move every per-block tensor (codes AND scales; KIVI's window / sealed state goes with a copy)."""

    def __init__(self, config: EngineConfig, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        kivi = config.kv_cache_dtype.startswith("kivi")
        super().__init__(config.kv_cache_dtype, num_layers, num_blocks, config.block_size, num_kv_heads, head_dim,
                         dtype, fp8_scales=config.kv_fp8_scales, device=device,
                         residual_length=config.kivi_residual_length if kivi else 0,
                         num_window_blocks=config.kivi_window_blocks if kivi else None)
        self.kivi = kivi
        self.k_cache = self.v_cache = None
        self.layer_caches = layer_caches(self, config.calculate_kv_scales)
        raw = [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in self.per_block.values()]   # fp8: as bytes
        self.pairs = [(t, torch.zeros((t.shape[0], config.swap_space_blocks, *t.shape[2:]), dtype=t.dtype)) for t in raw]

    def add_per_block(self, tensor: Tensor) -> None:
        raise ValueError("a quantized KV cache keeps no other per-block tensors; use kv_cache_dtype='auto'")

    def after_step(self, out) -> None:
        """KIVI: quantize the blocks of the sequences that advanced once they leave the window."""
        if not self.kivi:
            return
        for item in out.scheduled:
            seq = item.seq
            if not item.idle and seq.block_table:
                self.commit(torch.tensor(seq.block_table), seq.num_computed_tokens)

    def block_listener(self):
        """KIVI blocks follow the block manager (window / sealed state)."""
        return KiviBlockEvents(self) if self.kivi else None

    def transfer_tensors(self) -> list[Tensor]:
        raise ValueError("a quantized KV cache is not shipped between workers; use kv_cache_dtype='auto'")


def make_kv_store(config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device, value_dim: int | None = None):
    """The store `config` asks for, with `config.num_kv_blocks` blocks plus the null block."""
    num_blocks = config.num_kv_blocks + 1
    if config.kv_cache_dtype != "auto":
        return QuantizedKVStore(config, num_layers, num_blocks, num_kv_heads, head_dim, dtype, device)
    return PagedKVStore(num_layers, num_blocks, config.block_size, num_kv_heads, head_dim, dtype, device,
                        config.swap_space_blocks, value_dim)


class LayerKV:
    """K (which="k") or V ("v") of one layer of a `QuantizedPagedKV`, shaped like a cache tensor for the backends."""

    def __init__(self, store: QuantizedPagedKV, layer: int, which: str, calibrate: bool = False) -> None:
        self.store, self.layer, self.which = store, layer, which
        self.needs_calibration = calibrate and store.fmt.name.startswith("fp8")
        self.shape = (store.shape[1], *store.shape[2:])   # [num_blocks, block_size, Hkv, D]
        self.dtype, self.device = store.dtype, store.device

    @property
    def format(self) -> str:
        return self.store.fmt.name

    def codes(self) -> Tensor:
        """The stored codes of this layer [num_blocks, block_size, Hkv, D'] (int8 for "int8")."""
        return self.store.per_block[self.which][self.layer]

    def scales(self) -> Tensor:
        """INT8: the fp16 scale of every (slot, head) of this layer [num_blocks, block_size, Hkv]."""
        return self.store.per_block[self.which + "_scale"][self.layer]

    def index_select(self, dim: int, blocks: Tensor) -> Tensor:
        """Whole blocks, dequantized: [len(blocks), block_size, Hkv, D] in the engine's dtype."""
        if dim != 0:
            raise ValueError(f"a quantized cache is gathered by block (dim 0), got dim {dim}")
        return self.store.gather(self.layer, blocks, self.which)

    def write(self, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store this step's k, v [T, Hkv, D] (called on the K half) at cache `slots` [T]."""
        if self.needs_calibration:   # calculate_kv_scales: the first forward sets this layer's static scales
            self.store.calibrate(self.layer, k, v)
            self.needs_calibration = False
        self.store.write(self.layer, slots, k, v)


def layer_caches(store: QuantizedPagedKV, calculate_kv_scales: bool = False) -> list[tuple[LayerKV, LayerKV]]:
    """(K, V) per layer: what `ModelRunner.forward` hands the backend for each layer."""
    return [(LayerKV(store, i, "k", calculate_kv_scales), LayerKV(store, i, "v")) for i in range(store.shape[0])]


class KiviBlockEvents:
    """Keeps a KIVI store's per-block state in step with the block manager (`BlockManager.listener`).

    released(block, cached): the block's last holder let go. If the prefix cache keeps it (a full block: hash
      prefix caching caches full blocks only) and it is still in the full-precision window, it is quantized now,
      so that it frees its window block and stays readable for a later hit; otherwise its window block is freed.
    reused(block): a free block is handed out again: it goes back to "unwritten" (a sealed block is rewritten).
    """

    def __init__(self, store: QuantizedPagedKV) -> None:
        self.store = store

    def released(self, block: int, cached: bool) -> None:
        if self.store.window_of[block] >= 0:
            if cached:
                self.store.seal(block)
            else:
                self.store.free([block])

    def reused(self, block: int) -> None:
        self.store.free([block])


def kivi_window_blocks(max_num_seqs: int, max_num_batched_tokens: int, block_size: int, residual_length: int) -> int:
    """Window pool blocks that hold every KIVI block not yet quantized: per running sequence its residual window
    and its last, partly filled block (residual / block_size + 1 after a commit), one more per sequence for a
    prefill chunk that starts inside a block, the blocks of one step's prefill tokens, and the null block (the
    padding slot)."""
    return max_num_seqs * (residual_length // block_size + 2) + -(-max_num_batched_tokens // block_size) + 1
