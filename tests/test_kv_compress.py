"""The pieces `llmso-lab bench kv-compress` and Lab 10 measure with: the paged store's round trip on one layer,
the teacher-forced continuation NLL from a (compressed) cache, and a quantized cache on a Hugging Face model."""
import pytest
import torch
import torch.nn.functional as F

from llmso_lab.bench.kv_compress import answer, quantize_cache_
from llmso_lab.kv.evict import compress_prefill, continuation_nll
from llmso_lab.kv.quant import (dequantize_int8, kivi_fake_quantize, quantize_fp8, quantize_int8, roundtrip_kv)
from llmso_lab.models.tiny import tiny_llama


def _kv(T=70, H=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, H, D, generator=g)
    k[:, :, 3] *= 12                                   # an outlier key channel, as real keys have
    return k, torch.randn(T, H, D, generator=g)


def test_roundtrip_matches_the_format_definitions():
    k, v = _kv()
    kq, vq = roundtrip_kv("int8", k, v)
    for x, xq in ((k, kq), (v, vq)):
        assert torch.equal(xq, dequantize_int8(*quantize_int8(x)))
    for bits in (4, 2):   # the store's blocks == KIVI's groups: bit-exact with the reference, window exact
        kq, vq = roundtrip_kv(f"kivi{bits}", k, v, block_size=16, residual_length=32)
        rk, rv = kivi_fake_quantize(k, v, bits, 16, 32)
        assert torch.equal(kq, rk) and torch.equal(vq, rv)
        assert torch.equal(kq[48:], k[48:]) and not torch.equal(kq[:48], k[:48])   # 70 - 32 -> 2 groups of 16
    kq, _ = roundtrip_kv("fp8_e4m3", k, v)
    q, s = quantize_fp8(k, "e4m3", "tensor")
    assert torch.allclose(kq, q.float() * s) and (kq - k).abs().max() <= k.abs().max() / 8


def test_continuation_nll_with_the_full_cache_is_the_plain_forward():
    model = tiny_llama(num_layers=2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (1, 40), generator=g)
    ctx, cont = ids[:, :30], ids[:, 30:]
    cache, last = compress_prefill(model, ctx, "full", 30)
    nll, n = continuation_nll(model, cache, last, cont, 30)
    with torch.no_grad():
        logits = model(ids).logits[0]
    want = F.cross_entropy(logits[29:39], ids[0, 30:40], reduction="sum").item()
    assert n == 10 and abs(nll - want) < 1e-3 * max(1.0, abs(want))
    # a compressed context changes it (and PyramidKV's uneven layers go token by token)
    cache, last = compress_prefill(model, ctx, "pyramidkv", 12, window=4)
    with pytest.raises(ValueError, match="sdpa"):
        continuation_nll(model, cache, last, cont, 30)
    model.set_attn_implementation("sdpa")
    assert abs(continuation_nll(model, cache, last, cont, 30)[0] - want) > 1e-3


def test_a_quantized_cache_changes_the_model_by_its_error():
    model = tiny_llama(num_layers=2)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 256, (1, 88), generator=g)
    ctx, cont = ids[:, :80], ids[:, 80:]                 # 80 - 32 exact tokens: 3 KIVI groups of 16 quantized
    ref = continuation_nll(model, *compress_prefill(model, ctx, "full", 80), cont, 80)[0]
    gaps = {}
    for fmt in ("int8", "kivi4", "kivi2"):
        cache, last = compress_prefill(model, ctx, "full", 80)
        before = cache.layers[0].keys.clone()
        quantize_cache_(cache, fmt)
        assert cache.layers[0].keys.shape == before.shape and not torch.equal(cache.layers[0].keys, before)
        gaps[fmt] = abs(continuation_nll(model, cache, last, cont, 80)[0] - ref)
    assert gaps["int8"] < gaps["kivi2"] and gaps["kivi4"] < gaps["kivi2"]
    # answer(): the first token comes from the full-precision prefill, so every format agrees on it
    c, q = ids[:, :76], ids[:, 76:80]
    full = answer(model, c, q, max_new_tokens=3)
    for fmt in ("int8", "kivi2"):
        assert answer(model, c, q, kv_cache_dtype=fmt, max_new_tokens=3)[0] == full[0]
