"""The checkpoint was already quantized once: SmolLM2's GGUF, its Q4_1 blocks decoded by hand, and what
round-to-nearest finds when it quantizes the weights we load from it (lecture 1-3).

GGUF (llama.cpp's file format) stores each tensor with a ggml type. Q4_1 cuts every row into blocks of 32
weights along the input dimension; a block is 20 bytes:

    d (fp16) | m (fp16) | 16 bytes of 4-bit codes      weight = d * q + m,  q in 0..15

Byte j of the 16 holds weight j in its low nibble and weight j + 16 in its high nibble (ggml's layout; our
`rtn.pack_bits` puts weights 2j and 2j + 1 in byte j instead: same codes, other bytes). `fetch_model` loaded
this file with transformers, which dequantized it to fp32 — so our fp32 weights lie exactly on Q4_1 grids,
and `rtn.quantize(w, 4, group_size=32, symmetric=False)` on them should find (nearly) those grids again.

Shapes here are PyTorch's [out, in] (ggml lists dimensions the other way round, [in, out]).

Measured on SmolLM2-135M-Instruct.Q4_1.gguf (gguf 0.19): 272 tensors. Q4_1: the 210 linear weights (7 per
layer x 30; 106.2M parameters, 66.4 MB, 5.0 bits per weight). Q8_0 (8-bit symmetric blocks of 32, 8.5 bits per
weight): the token embedding, which the tied LM head shares (28.3M parameters). F32: the 61 RMSNorm weights.
`compare_with_rtn` on all 210 Q4_1 tensors (3,317,760 blocks): every code equal, RTN's fp32 scale and minimum
equal to the fp16 d and m exactly, dequantized weights equal bit for bit. Why exactly: every block uses codes
0 and 15 (llama.cpp maps a block's min to 0 and its max to 15), so RTN's min is m and its max is 15 d + m; with
11-bit fp16 d and m these sums are exact in fp32, and (15 d + m - m) / 15 gives d back. q and k rows come
permuted by the RoPE pairing (60 tensors), the others in the same order. (The Q8_0 embedding is likewise
found again, bit for bit, by `rtn.quantize(w, 8, group_size=32, symmetric=True)`.)
"""
from __future__ import annotations

import functools
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from llmso_lab.quant.rtn import quantize

__all__ = ["Q4_1_BLOCK", "Q4_1_BYTES", "gguf_tensor_types", "gguf_type_summary", "q4_1_blocks", "q4_1_dequantize",
           "q4_1_pack", "hf_name", "rope_row_permutation", "compare_with_rtn"]

Q4_1_BLOCK, Q4_1_BYTES = 32, 20   # weights per block, bytes per block (2 + 2 + 16)


@functools.lru_cache(maxsize=2)
def _reader(path: str):
    """One `gguf.GGUFReader` per file (it memory-maps the file; parsing the 49K-token vocabulary takes seconds)."""
    from gguf import GGUFReader
    return GGUFReader(path)


def _tensors(path: str | Path) -> dict:
    return {t.name: t for t in _reader(str(path)).tensors}


def gguf_tensor_types(path: str | Path) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(GGUF name, ggml type name, shape in PyTorch order, bytes stored) for each tensor, in file order."""
    return [(t.name, t.tensor_type.name, tuple(int(s) for s in reversed(t.shape)), int(t.n_bytes))
            for t in _reader(str(path)).tensors]


def gguf_type_summary(path: str | Path) -> dict[str, dict]:
    """Per ggml type: how many tensors, parameters and bytes, bits per parameter, and which tensor kinds
    (the name with its block number dropped, e.g. "attn_q.weight")."""
    out: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "parameters": 0, "bytes": 0, "kinds": set()})
    for name, kind, shape, n_bytes in gguf_tensor_types(path):
        row = out[kind]
        row["tensors"] += 1
        row["parameters"] += int(np.prod(shape))
        row["bytes"] += n_bytes
        row["kinds"].add(re.sub(r"^blk\.\d+\.", "", name))
    return {k: {**v, "kinds": sorted(v["kinds"]), "bits_per_parameter": 8 * v["bytes"] / v["parameters"]}
            for k, v in out.items()}


def q4_1_blocks(tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Decode a Q4_1 `ReaderTensor` (or its raw uint8 data [out, in / 32 * 20]) by hand:
    codes uint8 [out, in], d fp16 [out, in / 32], m fp16 [out, in / 32]."""
    raw = np.asarray(getattr(tensor, "data", tensor))
    if getattr(tensor, "tensor_type", None) is not None and tensor.tensor_type.name != "Q4_1":
        raise ValueError(f"{tensor.name} is {tensor.tensor_type.name}, not Q4_1")
    if raw.dtype != np.uint8 or raw.shape[-1] % Q4_1_BYTES:
        raise ValueError(f"expected uint8 rows of whole {Q4_1_BYTES}-byte blocks, got {raw.dtype} {raw.shape}")
    blocks = torch.from_numpy(np.array(raw)).reshape(raw.shape[0], -1, Q4_1_BYTES)   # a copy: the file is read-only
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]      # little-endian fp16, as ggml writes it
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    qs = blocks[..., 4:]                                                # [out, nb, 16]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)                     # low nibbles: weights 0..15; high: 16..31
    return codes.reshape(raw.shape[0], -1), d, m


def q4_1_dequantize(codes: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """fp32 [out, in] = d * q + m block by block, computed in fp32 as ggml (and gguf-py) do."""
    out_f, in_f = codes.shape
    q = codes.reshape(out_f, -1, Q4_1_BLOCK).float()
    return (d.float()[..., None] * q + m.float()[..., None]).reshape(out_f, in_f)


def q4_1_pack(codes: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """Inverse of `q4_1_blocks`: the raw Q4_1 bytes uint8 [out, in / 32 * 20] (ggml's nibble order)."""
    out_f = codes.shape[0]
    q = codes.to(torch.uint8).reshape(out_f, -1, Q4_1_BLOCK)
    qs = q[..., :16] | (q[..., 16:] << 4)
    dm = torch.stack([d.to(torch.float16), m.to(torch.float16)], -1).contiguous().view(torch.uint8)   # [out, nb, 4]
    return torch.cat([dm, qs], -1).reshape(out_f, -1)


_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
       "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
       "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> Hugging Face Llama name ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight")."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if not match or match.group(2) not in _HF:
        raise ValueError(f"no Hugging Face name known for GGUF tensor {gguf_name!r}")
    return f"model.layers.{match.group(1)}.{_HF[match.group(2)]}.weight"


def rope_row_permutation(n_rows: int, n_heads: int) -> Tensor:
    """Row order of the HF weight in terms of GGUF rows: hf[r] = gguf[perm[r]]. llama.cpp's converter permutes
    q and k rows per head (it pairs RoPE dimensions (i, i + d/2) as adjacent rows); transformers' GGUF loader
    undoes it (`_reverse_permute_weights`): [heads, d/2, 2] -> [heads, 2, d/2]."""
    half = n_rows // n_heads // 2
    return torch.arange(n_rows).reshape(n_heads, half, 2).transpose(1, 2).reshape(-1)


def _hf_weights(name: str) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    from llmso_lab.models.registry import fetch_model
    return load_file(str(fetch_model(name, verbose=False) / "model.safetensors"))


def compare_with_rtn(name: str = "smollm2-135m", path: str | Path | None = None,
                     only: tuple[str, ...] | None = None) -> list[dict]:
    """For each Q4_1 tensor of the model's GGUF (or those whose GGUF name contains one of `only`): quantize the
    cached fp32 weight with `rtn.quantize(w, 4, group_size=32, symmetric=False)` and compare with the GGUF's
    own blocks. Rows of q/k are matched through `rope_row_permutation` (detected: the HF weight must equal the
    GGUF's dequantized one, as is or permuted). Per tensor: `codes_equal` (fraction), `max_abs_d_diff` and
    `max_abs_m_diff` (RTN's fp32 scale and minimum vs the fp16 d and m), `dequant_bit_equal` (fraction of
    weights), `blocks_without_0_and_15` (blocks whose codes do not reach both ends: RTN's grid differs there)."""
    from llmso_lab.models.registry import gguf_path

    path = Path(path) if path is not None else gguf_path(name)
    reader = _reader(str(path))
    heads = {"attn_q": int(reader.fields["llama.attention.head_count"].contents()),
             "attn_k": int(reader.fields["llama.attention.head_count_kv"].contents())}
    hf = _hf_weights(name)
    rows = []
    for t in reader.tensors:
        if t.tensor_type.name != "Q4_1" or (only is not None and not any(o in t.name for o in only)):
            continue
        codes, d, m = q4_1_blocks(t)
        w = hf[hf_name(t.name)].float()                                       # [out, in]
        ref = q4_1_dequantize(codes, d, m)
        kind = t.name.split(".")[2]
        if torch.equal(w, ref):
            permuted = False
        elif kind in heads and torch.equal(w, ref[rope_row_permutation(w.shape[0], heads[kind])]):
            perm = rope_row_permutation(w.shape[0], heads[kind])
            codes, d, m, ref, permuted = codes[perm], d[perm], m[perm], ref[perm], True
        else:
            raise ValueError(f"{t.name}: the cached weight is not the GGUF's dequantized Q4_1 tensor, in either "
                             f"row order; the cache may come from another checkpoint (re-fetch the model)")
        qt = quantize(w, 4, group_size=Q4_1_BLOCK, symmetric=False)
        ours = qt.codes().to(torch.uint8)
        blocks = codes.reshape(*d.shape, Q4_1_BLOCK)
        rows.append({
            "gguf_name": t.name, "hf_name": hf_name(t.name), "shape": tuple(w.shape), "rope_permuted": permuted,
            "codes_equal": (ours == codes).float().mean().item(),
            "max_abs_d_diff": (qt.scale - d.float()).abs().max().item(),
            "max_abs_m_diff": (qt.minimum - m.float()).abs().max().item(),
            "max_rel_d_diff": ((qt.scale - d.float()).abs() / d.float().abs().clamp_min(1e-30)).max().item(),
            "dequant_bit_equal": (qt.dequantize() == ref).float().mean().item(),
            "blocks": d.numel(),
            "blocks_without_0_and_15": int(((blocks.amin(-1) != 0) | (blocks.amax(-1) != 15)).sum()),
        })
    return rows
