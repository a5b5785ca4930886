"""Quantized KV cache (lecture 2-4): FP8, INT8 and KIVI formats, and a paged store that keeps the compressed
form for real (packed codes + scales + zero points) and dequantizes on read.

Formats (`KV_FORMATS`):
- "auto": the compute dtype, no compression (the baseline).
- "fp8_e4m3" / "fp8_e5m2": one FP8 number per element, x ~ fp8 * scale. The scales are static, per layer
  ("tensor") or per layer and KV head ("head"), as vLLM's `k_scale` / `v_scale`: tokens arrive one at a time,
  so a scale cannot follow the data without re-quantizing what is stored. `calibrate` sets them from sample
  K/V (absmax / finfo.max); values beyond the calibrated range saturate. Default 1.0, vLLM's default.
- "int8": symmetric, one scale per (token, head), computed when the token is written.
- "kivi4" / "kivi2" (Liu et al., 2024): asymmetric 4 / 2-bit codes, packed two / four per byte. Keys are
  quantized PER CHANNEL: over a group of `group_size` tokens every (head, channel) gets its own scale and zero
  point, because a few key channels carry outliers far larger than the rest (a per-token scale would be set by
  the outlier and leave the other channels a handful of levels). Values have no such channels and are
  quantized PER TOKEN (one scale / zero per (token, head)). The most recent `residual_length` tokens stay in
  full precision; a group is quantized once all its tokens have left that window.

Choices for KIVI in the paged store: group_size == block_size. A block is the unit the allocator hands out,
shares (prefix caching, copy-on-write) and frees; with one key group per block each block carries its own
per-channel scales ([Hkv, D] per block) and never depends on a neighbour. The tokens of a block that is not yet
quantized (the last, partly filled one, and those inside the residual window) live in a small full-precision
"window pool" of blocks; `commit(block_table, length)` (after a step, for all layers at once) quantizes the
blocks that have left the window and returns their window blocks to the pool. Keys and values share that
boundary (KIVI quantizes values token by token as they leave the window; block-wise is simpler and keeps the
two in step). Prefill attention therefore reads full-precision K/V, as in KIVI.

Scales and zero points of INT8 and KIVI are stored in fp16 (as KIVI's kernels and GGUF do); they are rounded
outward (scale up, zero point down) BEFORE the codes are computed, so every value stays inside its grid and the
dequantization error is at most scale / 2.

Measured on SmolLM2-135M (30 layers, 3 KV heads, head_dim 64; first 256 tokens of the eval text, layer 15;
relative Frobenius errors). Bytes per token (fp16 baseline 23,040): fp8 11,520; int8 11,880; kivi4 7,560 /
kivi2 4,680 with block_size 16 (6,840 / 3,960 with 32: the per-channel key metadata, 4 bytes per channel per
group, is 1,440 of them at 16). Keys, 4-bit: per channel 0.030 vs per token 0.119; 2-bit: 0.152 vs 0.580 (the
largest key channel reaches 15.0, the median channel 3.6). Attention output vs fp32 SDPA: int8 0.016,
fp8_e4m3 0.038, fp8_e5m2 0.081, kivi4 0.097, kivi2 0.555 (32-token full-precision window).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llmso_lab.quant.rtn import grid_codes, grid_values, pack_bits, unpack_bits
from llmso_lab.quant.w8a8 import FP8_FORMATS, to_fp8

__all__ = ["KVFormat", "KV_FORMATS", "quantize_fp8", "dequantize_fp8", "quantize_int8", "dequantize_int8",
           "AsymQuantized", "quantize_asym", "kivi_quantize_keys", "kivi_quantize_values", "kivi_fake_quantize",
           "QuantizedPagedKV", "kv_bytes_per_token", "roundtrip_kv"]

META_DTYPE = torch.float16   # scales / zero points of the per-token and per-group formats


@dataclass(frozen=True)
class KVFormat:
    name: str
    bits: int                  # bits per stored element (codes)
    storage: torch.dtype | None  # element dtype of the data tensors (None: the compute dtype)
    scales: str                # what the scales are


KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in [
    KVFormat("auto", 16, None, "none: K/V in the compute dtype"),
    KVFormat("fp8_e4m3", 8, FP8_FORMATS["e4m3"], "static fp32 scale per layer or per (layer, KV head), K and V"),
    KVFormat("fp8_e5m2", 8, FP8_FORMATS["e5m2"], "static fp32 scale per layer or per (layer, KV head), K and V"),
    KVFormat("int8", 8, torch.int8, "fp16 scale per (token, head), symmetric, K and V"),
    KVFormat("kivi4", 4, torch.uint8, "K: fp16 scale + zero per (block, head, channel); V: per (token, head)"),
    KVFormat("kivi2", 2, torch.uint8, "K: fp16 scale + zero per (block, head, channel); V: per (token, head)"),
]}


def _format(name: str) -> KVFormat:
    if name not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_FORMATS)}, got {name!r}")
    return KV_FORMATS[name]


def _round_meta(x: Tensor, up: bool) -> Tensor:
    """x (fp32) rounded to META_DTYPE towards +inf (up) or -inf: the stored grid then still covers x."""
    r = x.to(META_DTYPE)
    off = r.float() < x if up else r.float() > x
    return torch.where(off, torch.nextafter(r, torch.full_like(r, float("inf") if up else -float("inf"))), r)


# ----------------------------------------------------------------------------------------------- FP8, INT8

def quantize_fp8(x: Tensor, fmt: str = "e4m3", per: str = "tensor", scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [T, H, D] -> (fp8 [T, H, D], fp32 scale: [1] per tensor or [H] per head), x ~ fp8 * scale.
    `scale` given: use it (static, values beyond scale * finfo.max saturate); None: absmax / finfo.max of x."""
    if per not in ("tensor", "head"):
        raise ValueError(f"per must be 'tensor' or 'head', got {per!r}")
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fmt must be one of {list(FP8_FORMATS)}, got {fmt!r}")
    if scale is None:   # w8a8.to_fp8 computes absmax / finfo.max: per tensor, or per row of [H, T * D]
        rows = x.reshape(1, -1) if per == "tensor" else x.transpose(0, 1).reshape(x.shape[1], -1)
        scale = to_fp8(rows, fmt, per="token")[1].reshape(-1)
    fmax = torch.finfo(FP8_FORMATS[fmt]).max
    q = (x.float() / scale.float()[:, None]).clamp(-fmax, fmax).to(FP8_FORMATS[fmt])
    return q, scale.float()


def dequantize_fp8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """fp8 [..., H, D] and scale [1] or [H] -> values in `dtype`."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (int8 codes [..., D], fp16 scale [...]): symmetric, scale = absmax / 127 per row (token, head)."""
    scale = _round_meta((x.float().abs().amax(-1) / 127).clamp_min(1e-6), up=True)
    return grid_codes(x.float(), scale.float(), None, 8).to(torch.int8), scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return grid_values(q.float(), scale.float(), None).to(dtype)


# ----------------------------------------------------------------------------------------------- KIVI

@dataclass
class AsymQuantized:
    """Asymmetric codes packed along the last dimension (D) plus the fp16 grid they live on."""
    packed: Tensor    # uint8 [..., D * bits / 8]
    scale: Tensor     # fp16, the grid step: [H, D] per channel (keys) or [T, H] per token (values)
    zero: Tensor      # fp16, the grid's lowest value, same shape as scale
    bits: int
    per: str          # "channel" (statistics over tokens, dim 0) or "token" (over D, the last dim)

    def codes(self) -> Tensor:
        return unpack_bits(self.packed, self.bits, self.packed.shape[-1] * 8 // self.bits)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        q, s, z = self.codes().float(), self.scale.float(), self.zero.float()
        if self.per == "channel":
            return (q * s + z).to(dtype)                   # [G, H, D] * [H, D]
        return (q * s[..., None] + z[..., None]).to(dtype)


def quantize_asym(x: Tensor, bits: int, per: str) -> AsymQuantized:
    """x [T, H, D] -> `AsymQuantized`: `bits`-bit codes with one (scale, zero) per (head, channel) over all T tokens
    (per="channel") or per (token, head) over D (per="token"). Error per element <= scale / 2."""
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8 (whole codes per byte), got {bits}")
    if per not in ("channel", "token"):
        raise ValueError(f"per must be 'channel' or 'token', got {per!r}")
    x = x.float()
    rows = x.permute(1, 2, 0) if per == "channel" else x          # statistics along the last dim of `rows`
    zero = _round_meta(rows.amin(-1), up=False)
    scale = _round_meta(((rows.amax(-1) - zero.float()) / ((1 << bits) - 1)).clamp_min(1e-6), up=True)
    codes = grid_codes(rows, scale.float(), zero.float(), bits).to(torch.uint8)
    if per == "channel":
        codes = codes.permute(2, 0, 1)                             # back to [T, H, D]
    return AsymQuantized(pack_bits(codes.contiguous(), bits), scale, zero, bits, per)


def kivi_quantize_keys(k: Tensor, bits: int) -> AsymQuantized:
    """One group of keys [G, H, D], quantized per channel (KIVI)."""
    return quantize_asym(k, bits, "channel")


def kivi_quantize_values(v: Tensor, bits: int) -> AsymQuantized:
    """Values [T, H, D], quantized per token (KIVI)."""
    return quantize_asym(v, bits, "token")


def kivi_fake_quantize(k: Tensor, v: Tensor, bits: int, group_size: int, residual_length: int) -> tuple[Tensor, Tensor]:
    """What a KIVI cache holding the sequence k, v [T, H, D] gives back: the oldest floor((T - R) / G) * G tokens
    quantized (keys per channel in groups of G tokens, values per token), the rest (the window) exact. fp32."""
    n_q = max(0, k.shape[0] - residual_length) // group_size * group_size
    k_hat, v_hat = k.float().clone(), v.float().clone()
    for s in range(0, n_q, group_size):
        k_hat[s:s + group_size] = kivi_quantize_keys(k[s:s + group_size], bits).dequantize()
    if n_q:
        v_hat[:n_q] = kivi_quantize_values(v[:n_q], bits).dequantize()
    return k_hat, v_hat


# ----------------------------------------------------------------------------------------------- paged store

class QuantizedPagedKV:
    """Per-layer paged K/V in one of `KV_FORMATS`, laid out like the engine's cache: data [L, num_blocks,
    block_size, Hkv, D'] (D' = D, or D * bits / 8 packed) with the scale tensors beside it.

    write(layer, slots, k, v)          k, v [T, Hkv, D] into cache slots (block * block_size + offset)
    read(layer, block_table, length)   -> (k, v) [length, Hkv, D] dequantized, in `dtype`
    commit(block_table, length)        KIVI: quantize (all layers) the blocks that left the residual window
    free(block_ids)                    KIVI: the blocks are reusable (back to "unwritten", window freed)
    calibrate(layer, k, v)             FP8: static scales from sample K/V
    bytes_per_token(), fixed_bytes()   measured on the tensors held (`per_block` grows with the cache, `fixed` not)

    KIVI's `num_window_blocks` (default: num_blocks, everything may stay full precision) must cover every block not
    yet quantized: about max_num_seqs * (residual_length / block_size + 1) + one prefill chunk's blocks.
    """

    def __init__(self, kv_cache_dtype: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, *, fp8_scales: str = "tensor",
                 group_size: int | None = None, residual_length: int = 0, num_window_blocks: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.fmt = _format(kv_cache_dtype)
        L, N, B, H, D = num_layers, num_blocks, block_size, num_kv_heads, head_dim
        if min(L, N, B, H, D) < 1:
            raise ValueError(f"num_layers, num_blocks, block_size, num_kv_heads, head_dim must be >= 1, "
                             f"got {(L, N, B, H, D)}")
        self.shape, self.dtype, self.device = (L, N, B, H, D), dtype, torch.device(device)
        self.block_size, self.num_kv_heads, self.head_dim = B, H, D
        self.per_block: dict[str, Tensor] = {}   # tensors that grow with the cache: bytes per token come from these
        self.fixed: dict[str, Tensor] = {}       # static scales, the KIVI window pool: a fixed cost
        name = self.fmt.name

        def new(shape, dt, fill=0.0):
            return torch.full(shape, fill, dtype=dt, device=self.device)

        if name == "auto":
            self.per_block.update(k=new((L, N, B, H, D), dtype), v=new((L, N, B, H, D), dtype))
        elif name.startswith("fp8"):
            if fp8_scales not in ("tensor", "head"):
                raise ValueError(f"fp8_scales must be 'tensor' or 'head', got {fp8_scales!r}")
            self.fp8_per = fp8_scales
            nh = 1 if fp8_scales == "tensor" else H
            self.per_block.update(k=new((L, N, B, H, D), self.fmt.storage), v=new((L, N, B, H, D), self.fmt.storage))
            self.fixed.update(k_scale=new((L, nh), torch.float32, 1.0), v_scale=new((L, nh), torch.float32, 1.0))
        elif name == "int8":
            self.per_block.update(k=new((L, N, B, H, D), torch.int8), v=new((L, N, B, H, D), torch.int8),
                                  k_scale=new((L, N, B, H), META_DTYPE), v_scale=new((L, N, B, H), META_DTYPE))
        else:   # kivi
            if group_size not in (None, B):
                raise ValueError(f"KIVI here uses one key group per block: group_size must equal block_size ({B}), "
                                 f"got {group_size}; change block_size instead")
            if residual_length < 0 or residual_length % B:
                raise ValueError(f"residual_length must be a non-negative multiple of block_size ({B}), "
                                 f"got {residual_length}")
            self.bits, self.residual_length = self.fmt.bits, residual_length
            Dp = D * self.bits // 8
            if (D * self.bits) % 8:
                raise ValueError(f"head_dim {D} at {self.bits} bits does not fill whole bytes")
            W = N if num_window_blocks is None else num_window_blocks
            self.per_block.update(k=new((L, N, B, H, Dp), torch.uint8), v=new((L, N, B, H, Dp), torch.uint8),
                                  k_scale=new((L, N, H, D), META_DTYPE), k_zero=new((L, N, H, D), META_DTYPE),
                                  v_scale=new((L, N, B, H), META_DTYPE), v_zero=new((L, N, B, H), META_DTYPE))
            self.fixed.update(k_window=new((L, W, B, H, D), dtype), v_window=new((L, W, B, H, D), dtype))
            self.sealed = torch.zeros(N, dtype=torch.bool)                  # block holds quantized codes
            self.window_of = torch.full((N,), -1, dtype=torch.int64)        # block -> window pool block, or -1
            self.free_windows = list(range(W - 1, -1, -1))

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def bytes_per_token(self) -> float:
        """Bytes one cached token costs, all layers, K and V: the per-block tensors' bytes / (blocks * block_size)."""
        L, N, B, H, D = self.shape
        return sum(t.numel() * t.element_size() for t in self.per_block.values()) / (N * B)

    def fixed_bytes(self) -> int:
        """Bytes that do not grow with the cache: FP8 static scales, the KIVI full-precision window pool."""
        return sum(t.numel() * t.element_size() for t in self.fixed.values())

    def calibrate(self, layer: int, k: Tensor, v: Tensor) -> None:
        """FP8: set the layer's static scales to absmax / finfo.max of sample k, v [T, Hkv, D]."""
        if not self.fmt.name.startswith("fp8"):
            raise ValueError(f"calibrate is for the fp8 formats, this store is {self.fmt.name!r}")
        for x, key in ((k, "k_scale"), (v, "v_scale")):
            self.fixed[key][layer] = quantize_fp8(x, self.fmt.name[4:], self.fp8_per)[1]

    def _kivi(self) -> None:
        if not self.fmt.name.startswith("kivi"):
            raise ValueError(f"commit / free are for the KIVI formats, this store is {self.fmt.name!r}")

    # -- write / read -----------------------------------------------------------------------------------------
    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v [T, Hkv, D] at `slots` [T] (int64, block * block_size + offset) of `layer`."""
        t, name, H, D = self.per_block, self.fmt.name, self.num_kv_heads, self.head_dim
        if k.shape != v.shape or k.shape[1:] != (H, D) or slots.shape != k.shape[:1]:
            raise ValueError(f"expected k, v [T, {H}, {D}] and slots [T], got {tuple(k.shape)}, {tuple(v.shape)}, "
                             f"{tuple(slots.shape)}")
        slots = slots.to(self.device, torch.int64)
        if name == "auto":
            for x, key in ((k, "k"), (v, "v")):
                t[key][layer].view(-1, H, D).index_copy_(0, slots, x.to(self.dtype))
        elif name.startswith("fp8"):
            for x, key in ((k, "k"), (v, "v")):
                q, _ = quantize_fp8(x, name[4:], self.fp8_per, self.fixed[key + "_scale"][layer])
                # copied as raw bytes: index_copy_ has no FP8 kernel on CPU
                t[key][layer].view(torch.uint8).view(-1, H, D).index_copy_(0, slots, q.view(torch.uint8))
        elif name == "int8":
            for x, key in ((k, "k"), (v, "v")):
                q, s = quantize_int8(x)
                t[key][layer].view(-1, H, D).index_copy_(0, slots, q)
                t[key + "_scale"][layer].view(-1, H).index_copy_(0, slots, s)
        else:   # KIVI: into the full-precision window pool; `commit` quantizes later
            blocks = (slots // self.block_size).cpu()
            touched = blocks.unique()
            if bool(self.sealed[touched].any()):
                b = int(touched[self.sealed[touched]][0])
                raise ValueError(f"block {b} is already quantized (sealed); call free([{b}]) before reusing it")
            new_blocks = touched[self.window_of[touched] < 0].tolist()
            if len(new_blocks) > len(self.free_windows):
                raise ValueError("the KIVI window pool is full: raise num_window_blocks (it must hold every block "
                                 "not yet quantized: the window and the last block of each sequence, plus a whole "
                                 "prefill chunk)")
            for b in new_blocks:
                self.window_of[b] = self.free_windows.pop()
            wslots = self.window_of[blocks].to(self.device) * self.block_size + slots % self.block_size
            for x, key in ((k, "k_window"), (v, "v_window")):
                self.fixed[key][layer].view(-1, H, D).index_copy_(0, wslots, x.to(self.dtype))

    def gather(self, layer: int, blocks: Tensor, which: str) -> Tensor:
        """K (which="k") or V ("v") of whole blocks [n] of `layer`, dequantized: [n, block_size, Hkv, D] in `dtype`.
        What the engine's attention backends read. A block never written (the padding of a block table) gives
        whatever is stored there (zeros for KIVI): the caller masks those positions."""
        if which not in ("k", "v"):
            raise ValueError(f"which must be 'k' or 'v', got {which!r}")
        t, name, blocks = self.per_block, self.fmt.name, blocks.to(self.device, torch.int64)
        if name == "auto":
            return t[which][layer].index_select(0, blocks)
        if name.startswith("fp8"):   # gathered as raw bytes (no FP8 index_select on CPU), then reinterpreted
            q = t[which][layer].view(torch.uint8).index_select(0, blocks).view(self.fmt.storage)
            return dequantize_fp8(q.flatten(0, 1), self.fixed[which + "_scale"][layer], self.dtype).view(q.shape)
        if name == "int8":
            return dequantize_int8(t[which][layer].index_select(0, blocks),
                                   t[which + "_scale"][layer].index_select(0, blocks), self.dtype)
        return self._gather_kivi(layer, blocks, which)

    def _gather_kivi(self, layer: int, blocks: Tensor, which: str) -> Tensor:
        t, cpu = self.per_block, blocks.cpu()
        sealed, win = self.sealed[cpu].to(self.device), self.window_of[cpu].to(self.device)
        out = torch.zeros(len(blocks), *self.shape[2:], dtype=self.dtype, device=self.device)
        if bool(sealed.any()):
            sb = blocks[sealed]
            if which == "k":   # per (block, head, channel): one grid per block, broadcast over its tokens
                q = AsymQuantized(t["k"][layer, sb], t["k_scale"][layer, sb][:, None], t["k_zero"][layer, sb][:, None],
                                  self.bits, "channel")
            else:
                q = AsymQuantized(t["v"][layer, sb], t["v_scale"][layer, sb], t["v_zero"][layer, sb], self.bits, "token")
            out[sealed] = q.dequantize(self.dtype)
        in_window = (~sealed) & (win >= 0)
        if bool(in_window.any()):
            out[in_window] = self.fixed[which + "_window"][layer, win[in_window]]
        return out

    def read(self, layer: int, block_table: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """The first `length` tokens of the sequence whose blocks are `block_table`: (k, v) [length, Hkv, D]."""
        B, H, D = self.block_size, self.num_kv_heads, self.head_dim
        nb = -(-length // B)
        if length < 1 or nb > len(block_table):
            raise ValueError(f"length {length} needs {nb} blocks, the block table has {len(block_table)}")
        blocks = block_table[:nb].to(self.device, torch.int64)
        t, name = self.per_block, self.fmt.name
        if name == "auto":
            k, v = (t[key][layer].index_select(0, blocks).float() for key in ("k", "v"))
        elif name.startswith("fp8"):
            k, v = (dequantize_fp8(t[key][layer].index_select(0, blocks), self.fixed[key + "_scale"][layer])
                    for key in ("k", "v"))
        elif name == "int8":
            k, v = (dequantize_int8(t[key][layer].index_select(0, blocks), t[key + "_scale"][layer].index_select(0, blocks))
                    for key in ("k", "v"))
        else:
            k, v = self._read_kivi(layer, blocks)
        return k.reshape(-1, H, D)[:length].to(self.dtype), v.reshape(-1, H, D)[:length].to(self.dtype)

    def _read_kivi(self, layer: int, blocks: Tensor) -> tuple[Tensor, Tensor]:
        B, H, D = self.block_size, self.num_kv_heads, self.head_dim
        sealed, win = self.sealed[blocks.cpu()].to(self.device), self.window_of[blocks.cpu()].to(self.device)
        if bool(((~sealed) & (win < 0)).any()):
            raise ValueError("the block table names a block that was never written")
        k = torch.empty(len(blocks), B, H, D, device=self.device)
        v = torch.empty_like(k)
        if bool(sealed.any()):
            sb, t = blocks[sealed], self.per_block
            k[sealed] = AsymQuantized(t["k"][layer, sb], t["k_scale"][layer, sb][:, None], t["k_zero"][layer, sb][:, None],
                                      self.bits, "channel").dequantize()
            v[sealed] = AsymQuantized(t["v"][layer, sb], t["v_scale"][layer, sb], t["v_zero"][layer, sb],
                                      self.bits, "token").dequantize()
        if bool((~sealed).any()):
            k[~sealed] = self.fixed["k_window"][layer, win[~sealed]].float()
            v[~sealed] = self.fixed["v_window"][layer, win[~sealed]].float()
        return k, v

    def commit(self, block_table: Tensor, length: int) -> int:
        """KIVI: quantize, in every layer, the blocks of this sequence whose tokens have all left the residual
        window (block i when (i + 1) * block_size <= length - residual_length). Returns how many it sealed."""
        self._kivi()
        t, B = self.per_block, self.block_size
        n = 0
        for b in block_table[:max(0, length - self.residual_length) // B].tolist():
            if self.sealed[b]:
                continue
            if self.window_of[b] < 0:
                raise ValueError(f"block {b} was never written")
            self.seal(b)
            n += 1
        return n

    def seal(self, b: int) -> None:
        """KIVI: quantize block `b` (every layer) from its window block, which goes back to the pool. The block must
        be full: its tokens form one key group."""
        self._kivi()
        w, t = int(self.window_of[b]), self.per_block
        for layer in range(self.shape[0]):
            qk = kivi_quantize_keys(self.fixed["k_window"][layer, w], self.bits)
            qv = kivi_quantize_values(self.fixed["v_window"][layer, w], self.bits)
            t["k"][layer, b], t["k_scale"][layer, b], t["k_zero"][layer, b] = qk.packed, qk.scale, qk.zero
            t["v"][layer, b], t["v_scale"][layer, b], t["v_zero"][layer, b] = qv.packed, qv.scale, qv.zero
        self.sealed[b], self.window_of[b] = True, -1
        self.free_windows.append(w)

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        """Copy blocks src -> dst for every layer: all per-block tensors (codes AND scales / zero points); KIVI also
        the block's state: a sealed block stays sealed, a block in the window gets its own window block."""
        if not mapping:
            return
        src, dst = (torch.tensor(x, device=self.device) for x in zip(*mapping))
        for x in self.per_block.values():
            x = x.view(torch.uint8) if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else x   # no FP8 index_copy_
            x.index_copy_(1, dst, x.index_select(1, src))
        if self.fmt.name.startswith("kivi"):
            self.free([d for _, d in mapping])
            for s, d in mapping:
                self.sealed[d] = self.sealed[s]
                if self.window_of[s] >= 0:
                    if not self.free_windows:
                        raise ValueError("the KIVI window pool is full: raise num_window_blocks")
                    w = self.window_of[d] = self.free_windows.pop()
                    for key in ("k_window", "v_window"):
                        self.fixed[key][:, w] = self.fixed[key][:, self.window_of[s]]

    def free(self, block_ids: list[int]) -> None:
        """KIVI: the blocks go back to "unwritten" (the allocator reuses them); their window blocks are freed."""
        self._kivi()
        for b in block_ids:
            if self.window_of[b] >= 0:
                self.free_windows.append(int(self.window_of[b]))
            self.sealed[b], self.window_of[b] = False, -1


def kv_bytes_per_token(kv_cache_dtype: str, num_kv_heads: int, head_dim: int, num_layers: int, block_size: int = 16,
                       dtype: torch.dtype = torch.float16) -> float:
    """Bytes per cached token of a format on a model shape, measured on the tensors of a one-block store
    (data + scales + zero points; KIVI's window pool and FP8's static scales are a fixed cost, not counted)."""
    store = QuantizedPagedKV(kv_cache_dtype, num_layers, 1, block_size, num_kv_heads, head_dim, dtype,
                             num_window_blocks=0)
    return store.bytes_per_token()


def roundtrip_kv(kv_cache_dtype: str, k: Tensor, v: Tensor, block_size: int = 16, residual_length: int = 32,
                 fp8_scales: str = "tensor") -> tuple[Tensor, Tensor]:
    """What the paged store gives back for one layer's sequence k, v [T, Hkv, D] once it is all written: the same
    `QuantizedPagedKV` the engine uses, in one layer, with the tokens in consecutive blocks. FP8 scales are
    calibrated on this k, v (static scales fitted to the data: the best case for FP8); KIVI commits every block
    that has left the last `residual_length` tokens (which stay exact). Returns fp32 (k_hat, v_hat)."""
    T, H, D = k.shape
    kivi = kv_cache_dtype.startswith("kivi")
    nb = -(-T // block_size)
    store = QuantizedPagedKV(kv_cache_dtype, 1, nb, block_size, H, D, torch.float32, fp8_scales=fp8_scales,
                             residual_length=residual_length if kivi else 0)
    if kv_cache_dtype.startswith("fp8"):
        store.calibrate(0, k, v)
    table = torch.arange(nb)
    store.write(0, torch.arange(T), k.float(), v.float())
    if kivi:
        store.commit(table, T)
    return store.read(0, table, T)
