"""KV-head conversion (issue 12, section 2): to_mha keeps the logits, to_gqa mean-pools groups of KV heads,
and both give ordinary Hugging Face models that HF `generate` and the engine run alike."""
from __future__ import annotations

import pytest
import torch

from llmso_lab.models import ModelShape, kv_head_counts, tiny_llama, tiny_mixtral, to_gqa, to_mha, to_mqa


def tiny_qwen2(num_heads: int = 4, num_kv_heads: int = 2):
    """Qwen2: q/k/v biases (random, so that pooling them is tested too), untied head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=256,
                      initializer_range=0.2, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                      attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.copy_(torch.randn(p.shape) * 0.5)
    return model


MODELS = {"llama 4q/2kv": lambda: tiny_llama(num_heads=4, num_kv_heads=2),
          "llama 8q/2kv sdpa": lambda: _sdpa(tiny_llama(hidden_size=128, num_heads=8, num_kv_heads=2)),
          "llama 6q/3kv": lambda: tiny_llama(hidden_size=96, num_heads=6, num_kv_heads=3),
          "qwen2 4q/2kv bias": tiny_qwen2,
          "mixtral 4q/2kv": lambda: tiny_mixtral(num_heads=4, num_kv_heads=2)}
IDS = torch.tensor([[1, 17, 200, 45, 3, 99, 128, 7, 64, 250, 12, 33]])


def _sdpa(model):
    model.config._attn_implementation = "sdpa"
    return model


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def per_head(weight: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """Rows of k_proj / v_proj split into one [D, ...] block per KV head (reference for the tests)."""
    return list(weight.detach().chunk(heads, dim=0))


@pytest.mark.parametrize("name", list(MODELS))
def test_to_mha_keeps_the_logits(name):
    model = MODELS[name]()
    heads, kv = kv_head_counts(model)
    mha = to_mha(model)
    assert kv_head_counts(mha) == (heads, heads) and mha.config.num_key_value_heads == heads
    assert torch.allclose(logits(mha), logits(model), atol=1e-5, rtol=0)
    # each query head i reads a copy of the KV head i // (heads / kv) it read before
    for old_layer, new_layer in zip(model.model.layers, mha.model.layers):
        for proj in ("k_proj", "v_proj"):
            old = per_head(getattr(old_layer.self_attn, proj).weight, kv)
            new = per_head(getattr(new_layer.self_attn, proj).weight, heads)
            assert all(torch.equal(new[i], old[i // (heads // kv)]) for i in range(heads))
    assert model.config.num_key_value_heads == kv and model.model.layers[0].self_attn.k_proj.out_features == kv * \
        (model.config.hidden_size // heads)   # the input is untouched
    shape, shape_mha = ModelShape.from_hf_config(model.config), ModelShape.from_hf_config(mha.config)
    assert shape_mha.kv_bytes_per_token(4) == heads // kv * shape.kv_bytes_per_token(4)


@pytest.mark.parametrize("name", list(MODELS))
def test_to_gqa_mean_pools_groups_of_kv_heads(name):
    model = MODELS[name]()
    heads, kv = kv_head_counts(model)
    for n in (d for d in range(1, kv) if kv % d == 0):
        pooled = to_gqa(model, n)
        assert kv_head_counts(pooled) == (heads, n)
        g = kv // n
        for old_layer, new_layer in zip(model.model.layers, pooled.model.layers):
            for proj in ("k_proj", "v_proj"):
                old_p, new_p = getattr(old_layer.self_attn, proj), getattr(new_layer.self_attn, proj)
                old, new = per_head(old_p.weight, kv), per_head(new_p.weight, n)
                for j in range(n):   # new head j = mean of old heads j*g .. j*g+g-1
                    assert torch.allclose(new[j], sum(old[j * g:(j + 1) * g]) / g, atol=1e-7)
                if old_p.bias is not None:
                    old_b, new_b = per_head(old_p.bias, kv), per_head(new_p.bias, n)
                    assert all(torch.allclose(new_b[j], sum(old_b[j * g:(j + 1) * g]) / g, atol=1e-7) for j in range(n))
        assert not torch.allclose(logits(pooled), logits(model), atol=1e-3)   # a different model until uptrained
    assert torch.allclose(logits(to_gqa(model, kv)), logits(model), atol=1e-6)           # nothing to pool
    assert torch.allclose(logits(to_gqa(to_mha(model), kv)), logits(model), atol=1e-5)   # copies averaged back


@pytest.mark.parametrize("name", ["llama 6q/3kv", "qwen2 4q/2kv bias"])
def test_converted_models_run_in_hf_generate_and_the_engine_alike(name):
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.engine.hf_reference import hf_greedy

    model = MODELS[name]()
    prompts = [[1, 5, 9, 200, 31], [1, 77, 3, 3, 140, 18, 250, 6, 90]]
    for variant in (to_mqa(model), to_mha(model)):
        llm = LLM(variant, block_size=4, max_model_len=64, num_kv_blocks=64)
        assert llm.model_runner.k_cache.shape[-2] == variant.config.num_key_value_heads
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
        for o, p in zip(outs, prompts):
            assert o.outputs[0].token_ids == hf_greedy(variant, p, 12)


def test_clear_errors():
    model = tiny_llama(hidden_size=128, num_heads=8, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"must divide the 8 query heads.*valid here: 1, 2, 4\)"):
        to_gqa(model, 3)
    with pytest.raises(ValueError, match=r"must divide the model's 4 KV heads.*valid here: 1, 2, 4\); to add KV heads use to_mha"):
        to_gqa(model, 8)
    with pytest.raises(ValueError, match="int >= 1"):
        to_gqa(model, 0)
    with pytest.raises(ValueError, match="must divide the model's 2 KV heads"):   # 4 divides 8 but not 2
        to_gqa(to_gqa(model, 2), 4)
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    mla = DeepseekV3ForCausalLM(DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8,
                                                 q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                                                 n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1))
    with pytest.raises(ValueError, match="no Llama-style attention"):
        to_mha(mla)


@pytest.mark.slow
def test_smollm2_mha_gqa_mqa():
    """SmolLM2 (9 query heads, 3 KV heads): MHA has the same logits and 3x the cache; MQA a third of it."""
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.engine.hf_reference import hf_greedy
    from llmso_lab.hardware import kv_cache_bytes
    from llmso_lab.models import load_model

    model, tok = load_model("smollm2-135m")
    ids = tok("The KV cache grows with every token a sequence keeps, so serving engines page it.",
              return_tensors="pt")["input_ids"]
    mha, mqa = to_mha(model), to_mqa(model)
    assert [kv_head_counts(m) for m in (mha, model, mqa)] == [(9, 9), (9, 3), (9, 1)]
    assert torch.allclose(logits(mha, ids), logits(model, ids), atol=1e-5, rtol=0)
    per_token = {m.config.num_key_value_heads: ModelShape.from_hf_config(m.config).kv_bytes_per_token(4)
                 for m in (mha, model, mqa)}
    assert per_token == {9: kv_cache_bytes(30, 9, 64, 4, 1), 3: kv_cache_bytes(30, 3, 64, 4, 1),
                         1: kv_cache_bytes(30, 1, 64, 4, 1)} and per_token[9] == 3 * per_token[3] == 9 * per_token[1]
    budget = 64 * 2**20
    blocks = {m.config.num_key_value_heads: LLM(m, tok, max_model_len=256, max_num_seqs=10_000,
                                                kv_cache_memory_bytes=budget).stats()["kv_blocks_total"]
              for m in (mha, model, mqa)}
    assert blocks == {h: budget // kv_cache_bytes(30, h, 64, 4, 16) for h in (9, 3, 1)}   # 30, 91, 273 blocks
    prompt = ids[0].tolist()
    out = LLM(mqa, tok, max_model_len=256).generate([{"prompt_token_ids": prompt}],
                                                     SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(mqa, prompt, 16)


def test_mean_pool_kv_heads_pools_consecutive_heads():
    from llmso_lab.models.kv_heads import mean_pool_kv_heads
    w = torch.arange(4 * 2 * 3, dtype=torch.float32).reshape(4 * 2, 3)   # 4 heads of D=2 rows
    out = mean_pool_kv_heads(w, 4, 2)
    assert torch.equal(out, torch.stack([(w[0:2] + w[2:4]) / 2, (w[4:6] + w[6:8]) / 2]).reshape(4, 3))
    assert torch.equal(mean_pool_kv_heads(w[:, 0], 4, 1), w[:, 0].reshape(4, 2).mean(0))   # a bias, MQA
    assert mean_pool_kv_heads(w.bfloat16(), 4, 2).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="must divide"):
        mean_pool_kv_heads(w, 4, 3)
