"""The engine on a quantized KV cache (`kv_cache_dtype`, `engine.kv_cache` over `kv.quant.QuantizedPagedKV`).

References: Hugging Face's own K/V for the same prompt (the cache must hold them within each format's error
bound), closed-form bytes per token, the "auto" engine's tokens (agreement reported; only the exact parts
asserted), and the torch backend for the Triton kernels (int8 dequantized inside the paged kernel)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from llmso_lab.engine import LLM, SamplingParams  # noqa: E402
from llmso_lab.engine.config import EngineConfig  # noqa: E402
from llmso_lab.kv.quant import KV_FORMATS, dequantize_int8, kivi_fake_quantize, quantize_int8  # noqa: E402
from llmso_lab.models import tiny_llama  # noqa: E402
from llmso_lab.models.tiny import tiny_deepseek_v3  # noqa: E402
from test_kv_quant import formula_bytes  # noqa: E402

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [1, 5, 9, 13, 17, 21, 25, 29, 60, 61], [7], [3, 4, 5, 6, 7, 8]]
QUANTIZED = [f for f in KV_FORMATS if f != "auto"]
L, HKV, D = 2, 2, 16   # tiny_llama: 2 layers, 2 KV heads, head_dim 64 / 4


def model():
    return tiny_llama(max_position_embeddings=128)


def engine(fmt: str, **kw) -> LLM:
    kw = {"block_size": 4, "max_model_len": 64, "kivi_residual_length": 8, **kw}
    return LLM(model(), kv_cache_dtype=fmt, **kw)


def generate(llm: LLM, prompts=PROMPTS, max_tokens: int = 12) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def formula_bytes_per_token(fmt: str, block_size: int, elem: int = 4) -> float:
    """The closed form of tests/test_kv_quant.py on the tiny model's shape (one home for the formula)."""
    return formula_bytes(fmt, L, HKV, D, block_size, elem)


# ----------------------------------------------------------------------------------------------- configuration

def test_validation_errors():
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp4'; valid: auto, fp8_e4m3, fp8_e5m2, int8, kivi4"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_fp8_scales"):
        EngineConfig(kv_cache_dtype="fp8_e4m3", kv_fp8_scales="channel")
    with pytest.raises(ValueError, match="multiple of block_size"):
        EngineConfig(kv_cache_dtype="kivi4", block_size=16, kivi_residual_length=24)
    EngineConfig(kivi_residual_length=24)   # ignored unless kivi
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(kv_cache_dtype="int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="preemption_mode='swap'"):
        EngineConfig(kv_cache_dtype="kivi2", preemption_mode="swap")
    with pytest.raises(ValueError, match="radix"):
        EngineConfig(kv_cache_dtype="kivi4", enable_prefix_caching=True, prefix_caching_algo="radix")
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(kv_cache_dtype="kivi4", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    EngineConfig(kv_cache_dtype="int8", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="MLA"):
        LLM(tiny_deepseek_v3(), kv_cache_dtype="int8", max_model_len=32)

    from llmso_lab.disagg.worker import DecodeEngine, PrefillEngine
    for worker in (PrefillEngine, DecodeEngine):   # the disaggregation workers ship the plain K/V tensors
        with pytest.raises(ValueError, match="supported by LLM itself"):
            worker(model(), kv_cache_dtype="int8", max_model_len=32)
    with pytest.raises(ValueError, match="KIVI window pool"):   # the window pool alone eats the budget
        engine("kivi4", kv_cache_memory_bytes=20_000)


@pytest.mark.parametrize("fmt", list(KV_FORMATS))
def test_bytes_per_token_and_blocks_under_a_fixed_budget(fmt):
    bs = 4
    budget = 1_000_000 if fmt.startswith("kivi") else 200_000   # KIVI: room for its window pool first
    llm = engine(fmt, kv_cache_memory_bytes=budget, max_num_seqs=64, max_num_batched_tokens=64)
    runner, per_token = llm.model_runner, formula_bytes_per_token(fmt, bs)
    if fmt == "auto":
        measured = sum(t.numel() * t.element_size() for t in (runner.k_cache, runner.v_cache)) / ((llm.config.num_kv_blocks + 1) * bs)
        fixed = 0
        assert (runner.kv_store.bytes_per_token(), runner.kv_store.fixed_bytes()) == (measured, 0)   # the same interface
    else:
        measured, fixed = runner.kv_store.bytes_per_token(), runner.kv_store.fixed_bytes()
    assert measured == per_token                                         # the engine's own tensors
    if fmt.startswith("kivi"):   # the full-precision window pool: max_num_seqs * (R/B + 2) + a step's blocks + null
        W = 64 * (8 // bs + 2) + 64 // bs + 1
        assert llm.config.kivi_window_blocks == W and fixed == W * bs * 2 * L * HKV * D * 4
    assert llm.config.num_kv_blocks == (budget - fixed) // int(per_token * bs)
    if fmt in ("int8", "fp8_e4m3"):   # the same budget holds (auto bytes / format bytes) times the blocks
        auto = (budget // int(formula_bytes_per_token("auto", bs) * bs))
        ratio = formula_bytes_per_token("auto", bs) / per_token
        assert abs(llm.config.num_kv_blocks / auto - ratio) < 0.02 * ratio


# ----------------------------------------------------------------------------------------------- what the cache holds

def hf_kv(prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Hugging Face's K (after RoPE) and V of every layer for `prompt`, each [T, Hkv, D]."""
    with torch.no_grad():
        out = model()(torch.tensor([prompt]), use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
    return [(cache.layers[i].keys[0].transpose(0, 1), cache.layers[i].values[0].transpose(0, 1)) for i in range(L)]


def prefilled(fmt: str, prompt: list[int]):
    """An engine after one step on `prompt`: (engine, the sequence, holding its blocks)."""
    llm = engine(fmt)
    llm.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True))
    llm.step()
    return llm, llm.scheduler.running[0]


PROMPT40 = [(7 * i + 3) % 256 for i in range(40)]


def test_int8_cache_holds_hf_kv_within_half_a_step():
    llm, seq = prefilled("int8", PROMPT40)
    store = llm.model_runner.kv_store
    assert store.per_block["k"].dtype == torch.int8 and store.per_block["k_scale"].dtype == torch.float16
    for layer, (k, v) in enumerate(hf_kv(PROMPT40)):
        got_k, got_v = store.read(layer, torch.tensor(seq.block_table), 40)
        for got, ref in ((got_k, k), (got_v, v)):
            _, scale = quantize_int8(ref)
            assert ((got - ref).abs() <= scale.float()[..., None] * 0.5001 + 1e-5).all()
            assert (got - ref).abs().max() > 0   # really quantized
        # the codes: HF's K re-quantized gives the same codes but where a value sits within float noise of a half step
        q, s = quantize_int8(k)
        assert (dequantize_int8(q, s) - got_k).abs().max() <= s.float().max() + 1e-5


@pytest.mark.parametrize("fmt", ["kivi4", "kivi2"])
def test_kivi_cache_seals_old_blocks_and_keeps_the_window(fmt):
    llm, seq = prefilled(fmt, PROMPT40)
    store, bits = llm.model_runner.kv_store, KV_FORMATS[fmt].bits
    table = torch.tensor(seq.block_table)
    # 40 tokens, window 8, block 4: blocks 0..7 (tokens 0..31) are quantized, 8 and 9 stay full precision
    assert store.sealed[table[:8]].all() and not store.sealed[table[8:10]].any()
    assert (store.window_of[table[8:10]] >= 0).all()
    for layer, (k, v) in enumerate(hf_kv(PROMPT40)):
        got_k, got_v = store.read(layer, table, 40)
        ref_k, ref_v = kivi_fake_quantize(k, v, bits, 4, 8)
        assert torch.allclose(got_k[32:], k[32:], atol=1e-5) and torch.allclose(got_v[32:], v[32:], atol=1e-5)
        step_k = (k[:32].reshape(8, 4, HKV, D).amax(1) - k[:32].reshape(8, 4, HKV, D).amin(1)) / (2 ** bits - 1)
        assert ((got_k[:32] - ref_k[:32]).abs().reshape(8, 4, HKV, D) <= step_k[:, None] * 1.01 + 1e-4).all()
        assert (got_k[:32] - k[:32]).abs().max() > 1e-3


def test_kivi_frees_window_blocks_and_commits_long_sequences():
    llm = engine("kivi4")
    store, W = llm.model_runner.kv_store, llm.config.kivi_window_blocks
    long_prompt = [(5 * i + 1) % 256 for i in range(30)]
    out = generate(llm, PROMPTS + [long_prompt], max_tokens=20)
    assert [len(o) for o in out] == [20] * 5
    # every sequence finished and was freed: all window blocks are back; the long one's sealed blocks stay sealed
    assert len(store.free_windows) == W and (store.window_of < 0).all()
    assert int(store.sealed.sum()) >= (30 + 20 - 8) // 4 - 1


# ----------------------------------------------------------------------------------------------- outputs

def test_quantized_engines_vs_auto_agreement():
    """First generated tokens come from prefill, which attends over the prompt's exact K/V: equal for every format.
    Later tokens read the dequantized cache; agreement is measured (printed), int8 is asserted to stay close."""
    ref = generate(engine("auto"), max_tokens=16)
    agreement = {}
    for fmt in QUANTIZED:
        got = generate(engine(fmt), max_tokens=16)
        assert [g[0] for g in got] == [r[0] for r in ref], fmt
        agreement[fmt] = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g)) / sum(map(len, ref))
    print("greedy token agreement with auto (tiny random Llama):", agreement)
    assert agreement["int8"] >= 0.5


@pytest.mark.parametrize("fmt", ["int8", "kivi4"])   # (fp8 takes KIVI's path: dequantized blocks, plain kernel)
def test_triton_backend_matches_torch_backend(fmt):
    ref = generate(engine(fmt), max_tokens=6)
    llm = engine(fmt, attention_backend="triton")
    calls = []
    paged = llm.model_runner.backend._paged
    llm.model_runner.backend._paged = lambda *a, **k: (calls.append(k.get("k_scale") is not None), paged(*a, **k))[1]
    assert generate(llm, max_tokens=6) == ref
    assert calls and all(calls) == (fmt == "int8")   # int8: the scales go into the kernel


def test_prefix_caching_hits_with_quantized_cache():
    prefix = [(11 * i + 2) % 256 for i in range(24)]
    prompts = [prefix + [100 + i, 3, 4] for i in range(3)]
    for fmt in ("int8", "kivi4"):
        llm = engine(fmt, enable_prefix_caching=True)
        outs = [generate(llm, [p], max_tokens=6)[0] for p in prompts]   # one after another: later ones hit
        assert all(len(o) == 6 for o in outs)
        assert llm.stats()["prefix_cache_hit_rate"] > 0.5, fmt
        if fmt == "kivi4":   # cached blocks were sealed when released, so they stay readable; no window leaks
            assert len(llm.model_runner.kv_store.free_windows) == llm.config.kivi_window_blocks


@pytest.mark.parametrize("fmt,mode", [("int8", "recompute"), ("int8", "swap"), ("kivi4", "recompute")])
def test_preemption_with_quantized_cache(fmt, mode):
    free = generate(engine(fmt), max_tokens=16)
    llm = engine(fmt, num_kv_blocks=16, preemption_mode=mode)
    got = generate(llm, max_tokens=16)
    assert llm.stats()["num_preemptions_total"] > 0
    assert [len(g) for g in got] == [16] * 4
    if mode == "swap":   # the codes and their scales came back: the same cache, the same tokens
        assert got == free
