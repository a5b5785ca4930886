"""Greedy engine output == Hugging Face `generate` (fp32), token for token, under every scheduler setting.

The workload has prompts of different lengths (one of a single token), shared prefixes (so prefix caching
hits), different max_tokens, and priorities. Small blocks (4 tokens) make a few dozen tokens span many
blocks; `num_kv_blocks` equal to one max-length sequence forces preemption; token budgets of 3 and 16
force chunked prefill.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.engine.hf_reference import hf_greedy
from llmso_lab.models import tiny_llama
from llmso_lab.models.tiny import _seeded

BLOCK, MAX_LEN = 4, 48
PREFIX = [17, 99, 4, 250, 31, 8, 77, 120, 5, 66, 201, 3]   # shared by most prompts: 3 full blocks
PROMPTS = [
    [42],                                                   # a one-token prompt
    [9, 8, 7, 6, 5, 4],
    PREFIX[:8] + [11, 12, 13],                              # shares 2 blocks
    PREFIX + [14, 15],                                      # shares 3 blocks
    PREFIX + [200, 100, 50, 25, 12, 6, 3],
    PREFIX[:8] + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
]
MAX_TOKENS = [12, 7, 15, 5, 10, 9]
PRIORITY = [2, 0, 1, 0, 3, 1]


def _seed_biases(model, seed: int = 1):
    """HF initialises biases to zero; make them random so that a missing bias would change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
                      rope_theta=1000.0, eos_token_id=2, bos_token_id=1, pad_token_id=0, attn_implementation="eager")
    return _seed_biases(_seeded(lambda: Qwen2ForCausalLM(cfg), 0, torch.float32))


def tiny_qwen2_sliding():
    """Qwen2 with per-layer attention types: layer 0 full, layer 1 a sliding window of 5."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, use_sliding_window=True,
                      sliding_window=5, max_window_layers=1, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                      attn_implementation="eager")
    return _seed_biases(_seeded(lambda: Qwen2ForCausalLM(cfg), 0, torch.float32))


def tiny_mistral():
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, sliding_window=7,
                        eos_token_id=2, bos_token_id=1, pad_token_id=0, attn_implementation="eager")
    return _seeded(lambda: MistralForCausalLM(cfg), 0, torch.float32)


def tiny_llama31():
    """Llama 3.1 RoPE scaling and an untied LM head."""
    from transformers import LlamaConfig, LlamaForCausalLM
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
                      rope_parameters=rope, eos_token_id=2, bos_token_id=1, pad_token_id=0, attn_implementation="eager")
    return _seeded(lambda: LlamaForCausalLM(cfg), 0, torch.float32)


MODELS = {"llama": lambda: tiny_llama(max_position_embeddings=256), "qwen2": tiny_qwen2,
          "mistral": tiny_mistral, "llama31": tiny_llama31, "qwen2sw": tiny_qwen2_sliding}
_cache: dict = {}


def model_and_reference(name: str):
    if name not in _cache:
        model = MODELS[name]()
        _cache[name] = model, [hf_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    return _cache[name]


def run_engine(model, **kwargs):
    llm = LLM(model, block_size=BLOCK, max_model_len=MAX_LEN, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS],
                        priority=PRIORITY, use_tqdm=False)
    llm.scheduler.check_invariants()
    assert llm.block_manager.num_used_blocks == 0, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs], llm.stats()


def assert_same(got, ref, label):
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g == r, f"{label}: request {i} differs from HF at token {next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))}: {g} vs {r}"


# chunking: (enable_chunked_prefill, max_num_batched_tokens); preemption: (num_kv_blocks, preemption_mode)
CHUNKING = {"nochunk": (False, MAX_LEN), "chunk3": (True, 3), "chunk16": (True, 16)}
PREEMPTION = {"roomy": (None, "recompute"), "recompute": (MAX_LEN // BLOCK, "recompute"), "swap": (MAX_LEN // BLOCK, "swap")}
POLICIES = ("fcfs", "priority", "sjf")
CONTINUOUS = list(itertools.product(CHUNKING, (False, True), PREEMPTION, POLICIES))


@pytest.mark.parametrize("chunking,prefix,preemption,policy", CONTINUOUS,
                         ids=[f"{c}-{'prefix' if p else 'noprefix'}-{e}-{pol}" for c, p, e, pol in CONTINUOUS])
def test_continuous_matches_hf(chunking, prefix, preemption, policy):
    model, ref = model_and_reference("llama")
    chunked, budget = CHUNKING[chunking]
    blocks, mode = PREEMPTION[preemption]
    got, stats = run_engine(model, enable_chunked_prefill=chunked, max_num_batched_tokens=budget,
                            enable_prefix_caching=prefix, num_kv_blocks=blocks, preemption_mode=mode,
                            scheduling_policy=policy)
    assert_same(got, ref, f"continuous {chunking} prefix={prefix} {preemption} {policy}")
    if preemption != "roomy":   # the tiny KV budget must really have forced preemption
        assert stats["num_preemptions_total"] > 0
    if preemption == "swap":
        assert stats["num_preemptions_swap"] > 0
    if prefix and preemption != "roomy":
        assert stats["prefix_cache_hit_rate"] > 0


STATIC = list(itertools.product(("static", "dynamic"), (False, True), ("roomy", "tight"), POLICIES))


@pytest.mark.parametrize("batching,prefix,kv,policy", STATIC,
                         ids=[f"{b}-{'prefix' if p else 'noprefix'}-{k}-{pol}" for b, p, k, pol in STATIC])
def test_static_and_dynamic_match_hf(batching, prefix, kv, policy):
    model, ref = model_and_reference("llama")
    got, stats = run_engine(model, batching=batching, max_num_seqs=4, enable_prefix_caching=prefix,
                            num_kv_blocks=MAX_LEN // BLOCK if kv == "tight" else None, scheduling_policy=policy,
                            batch_window_s=0.0)
    assert_same(got, ref, f"{batching} prefix={prefix} {kv} {policy}")
    assert stats["num_preemptions_total"] == 0     # static batches reserve their KV up front
    assert stats["num_padded_tokens"] > 0          # prompts of different lengths were padded


OTHER_MODELS = [("qwen2", dict()), ("qwen2", dict(max_num_batched_tokens=5, enable_prefix_caching=True, num_kv_blocks=12)),
                ("qwen2", dict(batching="static", max_num_seqs=3)),
                ("mistral", dict()), ("mistral", dict(max_num_batched_tokens=3, enable_prefix_caching=True, num_kv_blocks=12,
                                                      preemption_mode="swap")),
                ("mistral", dict(batching="static", max_num_seqs=3)),
                ("qwen2sw", dict()), ("qwen2sw", dict(max_num_batched_tokens=4, enable_prefix_caching=True, num_kv_blocks=12)),
                ("llama31", dict()), ("llama31", dict(max_num_batched_tokens=5, num_kv_blocks=12, scheduling_policy="priority"))]


@pytest.mark.parametrize("name,kwargs", OTHER_MODELS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(OTHER_MODELS)])
def test_other_architectures_match_hf(name, kwargs):
    model, ref = model_and_reference(name)
    got, _ = run_engine(model, **kwargs)
    assert_same(got, ref, f"{name} {kwargs}")


def test_sliding_window_is_exercised():
    """The Mistral workload is longer than its window, so a full-attention engine would differ."""
    model, ref = model_and_reference("mistral")
    assert model.config.sliding_window < max(len(p) + n for p, n in zip(PROMPTS, MAX_TOKENS))
    from llmso_lab.engine.cache_sizing import sliding_windows
    assert sliding_windows(model.config, MAX_LEN) == [7, 7]
    assert sliding_windows(model_and_reference("qwen2sw")[0].config, MAX_LEN) == [None, 5]
    assert sliding_windows(model.config, 7) == [None, None]   # a window covering max_model_len is full attention


@pytest.mark.parametrize("rope", [None, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                  {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
                                  {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}],
                         ids=["default", "llama3", "linear", "yarn"])
def test_rope_tables_match_hf(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from llmso_lab.engine.ops import rope_cos_sin
    kw = {} if rope is None else {"rope_parameters": rope}
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256, **kw)
    cos, sin = rope_cos_sin(cfg, 256)
    ref_cos, ref_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1), torch.arange(256)[None])
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=0)


def test_eos_and_stop_tokens_match_hf():
    """Without ignore_eos the engine stops at EOS like HF generate, and at stop_token_ids."""
    model = tiny_llama(max_position_embeddings=256, seed=3)
    prompt = [5, 6, 7, 8, 9]
    free_run = hf_greedy(model, prompt, 20)
    eos = free_run[6]   # a token the model really produces
    model.generation_config.eos_token_id = eos
    expected = hf_greedy(model, prompt, 20, eos_token_id=eos)
    assert expected[-1] == eos and len(expected) <= 7
    llm = LLM(model, block_size=BLOCK, max_model_len=MAX_LEN)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected and out.finish_reason == "stop"
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run and out.finish_reason == "length"
    stop = free_run[3]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[:free_run.index(stop) + 1] and out.finish_reason == "stop"


def test_max_model_len_truncates_with_length():
    model, ref = model_and_reference("llama")
    llm = LLM(model, block_size=BLOCK, max_model_len=20)
    out = llm.generate({"prompt_token_ids": PROMPTS[4]}, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert len(PROMPTS[4]) + len(out.outputs[0].token_ids) == 20
    assert out.outputs[0].token_ids == ref[4][:20 - len(PROMPTS[4])] and out.outputs[0].finish_reason == "length"


SPLIT = [("llama", dict()), ("llama", dict(max_num_batched_tokens=3, enable_prefix_caching=True, num_kv_blocks=MAX_LEN // BLOCK)),
         ("llama", dict(batching="static", max_num_seqs=4)), ("mistral", dict()), ("qwen2sw", dict(max_num_batched_tokens=4))]


@pytest.mark.parametrize("name,kwargs", SPLIT, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SPLIT)])
def test_decode_length_groups_match_hf(name, kwargs, monkeypatch):
    """Free groups: the torch backend splits every decode batch by block count, and tokens stay HF's."""
    from llmso_lab.engine import attention

    monkeypatch.setenv("LLMSO_LAB_NATIVE", "0")   # the torch path's decode groups (the native path reads no groups)
    monkeypatch.setattr(attention.TorchAttentionBackend, "decode_group_cost", 0)
    calls = []
    split = attention.plan_decode_groups
    monkeypatch.setattr(attention, "plan_decode_groups", lambda *a: calls.append(split(*a)) or calls[-1])
    model, ref = model_and_reference(name)
    got, _ = run_engine(model, **kwargs)
    assert_same(got, ref, f"{name} {kwargs} split by length")
    assert max(len(groups) for groups in calls) > 1, "no decode batch was split"


@pytest.mark.parametrize("fake_hash", [lambda parent, tokens: 0, lambda parent, tokens: hash((parent, tokens)) % 3],
                         ids=["constant", "three-values"])
def test_prefix_cache_stays_exact_under_hash_collisions(monkeypatch, fake_hash):
    """Forced hash collisions (every block hashes alike, or to one of 3 values) on prompts whose blocks repeat:
    prefix caching must still give HF's tokens, reusing only blocks with the same tokens after the same prefix."""
    import llmso_lab.kv.block_manager as block_manager

    monkeypatch.setattr(block_manager, "hash_block", fake_hash)
    model, _ = model_and_reference("llama")
    rep = [17, 99, 4, 250]
    prompts = [rep * 3 + [5], rep * 2 + [8, 7, 6, 5] + rep + [1], rep * 4 + [2], [8, 7, 6, 5] + rep * 2 + [3]]
    ref = [hf_greedy(model, p, 6) for p in prompts]
    llm = LLM(model, block_size=BLOCK, max_model_len=MAX_LEN, enable_prefix_caching=True, max_num_seqs=1)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                        SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)]
    assert_same(got, ref, "prefix caching under hash collisions")
    assert llm.stats()["prefix_cache_hit_tokens"] > 0   # exact hits still happen
