"""The engine's quantized KV cache (`kv_cache_dtype` other than "auto", lecture 2-4): glue between the paged store
`llmso_lab.kv.quant.QuantizedPagedKV` (compressed codes + scales, dequantized on read) and the engine.

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

from torch import Tensor

from llmso_lab.kv.quant import QuantizedPagedKV


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
    """Keeps a KIVI store's per-block state in step with the block manager (`BlockManager.events`).

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
