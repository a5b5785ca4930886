"""KV-cache sizing (issue 12, section 1): the lecture's numbers, every preset from first principles and from its
published config (parameter counts against Hugging Face's own modules), MLA's latent cache, the max-batch
arithmetic, and the engine sizing its cache with the same function."""
from __future__ import annotations

import math

import pytest
import torch

from llmso_lab import hardware as hw
from llmso_lab.models.shapes import (DEEPSEEK_V2, DEEPSEEK_V3, KV_SIZING_PRESETS, LLAMA3_8B, LLAMA3_70B, MISTRAL_7B,
                                     MODEL_SHAPES, QWEN25_7B, SMOLLM2_135M, ModelShape, kv_sizing_table)


def test_lecture_numbers():
    # "80레이어, KV 헤드 8개, head_dim 128, FP16이면 토큰당 약 320KB ... 8K 프롬프트면 약 2.6GB ... 약 50GB/s로 50ms 남짓"
    per_token = hw.kv_cache_bytes(80, 8, 128, 2, num_tokens=1)
    assert per_token == hw.kv_bytes_per_token(80, 8, 128, 2) == 327_680 == 320 * 1024
    prompt = hw.kv_cache_bytes(80, 8, 128, 2, num_tokens=8192)
    assert prompt == 2_684_354_560 and prompt / 1e9 == pytest.approx(2.68, abs=0.005)   # "about 2.6 GB"
    assert prompt / 50e9 == pytest.approx(0.054, abs=0.001)                           # "a little over 50 ms"
    assert LLAMA3_70B.kv_bytes_per_token(2) == per_token and LLAMA3_70B.kv_cache_bytes(8192) == prompt


@pytest.mark.parametrize("layers, kv_heads, head_dim, nbytes, tokens, batch",
                         [(80, 8, 128, 2, 8192, 1), (30, 3, 64, 4, 1000, 7), (32, 8, 128, 1, 4096, 32),
                          (61, 1, 576, 0.5, 3, 2), (1, 1, 1, 2, 0, 5)])
def test_kv_cache_bytes_is_the_lectures_formula(layers, kv_heads, head_dim, nbytes, tokens, batch):
    # KV 캐시 = 2 × layers × kv_heads × head_dim × dtype_bytes × seq_len × batch
    assert hw.kv_cache_bytes(layers, kv_heads, head_dim, nbytes, tokens, batch) == \
        2 * layers * kv_heads * head_dim * nbytes * tokens * batch
    assert hw.kv_cache_bytes(layers, kv_heads, head_dim, nbytes, tokens) == \
        hw.kv_cache_bytes(layers, kv_heads, head_dim, nbytes, tokens, batch) // batch


# bf16 bytes per token, worked out by hand: 2 (K and V) x layers x KV heads x head_dim x 2 bytes;
# MLA: layers x (kv_lora_rank + qk_rope_head_dim) x 2 bytes
BY_HAND = {"Llama-3-8B": 2 * 32 * 8 * 128 * 2,          # 131,072 = 128 KiB
           "Llama-3-70B": 2 * 80 * 8 * 128 * 2,         # 327,680 = 320 KiB
           "Mistral-7B-v0.3": 2 * 32 * 8 * 128 * 2,     # 131,072
           "Qwen2.5-7B": 2 * 28 * 4 * 128 * 2,          # 57,344 = 56 KiB
           "DeepSeek-V2": 60 * (512 + 64) * 2,          # 69,120 = 67.5 KiB
           "DeepSeek-V3": 61 * (512 + 64) * 2,          # 70,272 = 68.6 KiB
           "SmolLM2-135M": 2 * 30 * 3 * 64 * 2}         # 23,040 = 22.5 KiB


def test_every_preset_kv_bytes_per_token_by_hand():
    assert {m.name for m in KV_SIZING_PRESETS} == set(BY_HAND)
    assert BY_HAND == {"Llama-3-8B": 131_072, "Llama-3-70B": 327_680, "Mistral-7B-v0.3": 131_072, "Qwen2.5-7B": 57_344,
                       "DeepSeek-V2": 69_120, "DeepSeek-V3": 70_272, "SmolLM2-135M": 23_040}
    for m in KV_SIZING_PRESETS:
        assert m.kv_bytes_per_token(2) == BY_HAND[m.name], m.name
        assert m.kv_bytes_per_token(1) * 2 == m.kv_bytes_per_token(2) == m.kv_bytes_per_token(4) // 2
        for n, b in ((8192, 1), (32768, 3), (131072, 2)):
            assert m.kv_cache_bytes(n, b) == BY_HAND[m.name] * n * b


def test_mla_latent_cache():
    # DeepSeek-V2 paper, Table 1: MLA caches (d_c + d_h^R) l = 9/2 d_h l elements per token (d_c = 4 d_h,
    # d_h^R = d_h / 2, d_h = 128): the same as GQA with 2.25 groups, no factor 2 for K and V.
    for m in (DEEPSEEK_V2, DEEPSEEK_V3):
        assert m.attention == "MLA" and m.kv_lora_rank == 4 * 128 and m.qk_rope_head_dim == 128 // 2
        assert m.kv_bytes_per_token(1) == 4.5 * 128 * m.num_layers
        assert m.kv_bytes_per_token(2) == hw.kv_bytes_per_token(m.num_layers, 2.25, 128, 2)
        assert m.kv_bytes_per_token(2) == hw.mla_kv_bytes_per_token(m.num_layers, 512, 64, 2)
        assert m.kv_cache_bytes(8192, 4) == hw.mla_kv_cache_bytes(m.num_layers, 512, 64, 2, 8192, 4) \
            == m.num_layers * 576 * 2 * 8192 * 4
        # what its 128 heads would cache as plain MHA (K of 192 and V of 128 per head): ~57x more
        mha = m.num_layers * 128 * (192 + 128) * 2
        assert mha / m.kv_bytes_per_token(2) == pytest.approx(71.1, abs=0.1)
    assert hw.mla_kv_bytes_per_token(61, 512, 64, 2) == 70_272 and hw.mla_kv_bytes_per_token(60, 512, 64, 1) == 34_560


# Each model's config.json (the fields a shape needs), as published on its Hugging Face page.
CONFIGS = {
    "Llama-3-8B": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_hidden_layers=32,
                                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)),
    "Llama-3-70B": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_hidden_layers=80,
                                  num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)),
    "Mistral-7B-v0.3": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                        num_hidden_layers=32, num_key_value_heads=8, vocab_size=32768, head_dim=128,
                                        sliding_window=None, tie_word_embeddings=False)),
    "Qwen2.5-7B": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_hidden_layers=28,
                                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)),
    "DeepSeek-V2": ("deepseek_v2", dict(hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
                                        num_hidden_layers=60, num_attention_heads=128, num_key_value_heads=128,
                                        n_shared_experts=2, n_routed_experts=160, num_experts_per_tok=6,
                                        first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                                        v_head_dim=128, qk_nope_head_dim=128, vocab_size=102400, tie_word_embeddings=False)),
    "DeepSeek-V3": ("deepseek_v3", dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                                        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                                        n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
                                        first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                                        v_head_dim=128, qk_nope_head_dim=128, vocab_size=129280, tie_word_embeddings=False)),
    "SmolLM2-135M": ("llama", dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_hidden_layers=30,
                                   num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)),
}
# Totals the model cards / papers state (DeepSeek: total and activated per token, without V3's MTP module).
PUBLISHED_B = {"Llama-3-8B": 8.03, "Llama-3-70B": 70.6, "Mistral-7B-v0.3": 7.25, "Qwen2.5-7B": 7.61,
               "DeepSeek-V2": 236, "DeepSeek-V3": 671, "SmolLM2-135M": 0.135}


def _hf_config(name: str):
    from transformers import AutoConfig

    model_type, fields = CONFIGS[name]
    return AutoConfig.for_model(model_type, **fields)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_presets_are_the_published_configs_and_count_like_hugging_face(name):
    from transformers import AutoModelForCausalLM

    preset, cfg = MODEL_SHAPES[name.lower()], _hf_config(name)
    from_config = ModelShape.from_hf_config(cfg, name=name)
    assert from_config == preset
    with torch.device("meta"):   # shapes only: no memory, no time
        model = AutoModelForCausalLM.from_config(cfg)
    assert preset.param_count == sum(p.numel() for p in model.parameters())
    assert preset.param_count / 1e9 == pytest.approx(PUBLISHED_B[name], rel=0.005)


def test_deepseek_activated_params():
    # V2: "236B total parameters, of which 21B are activated for each token"; V3: 671B and 37B
    for m, total, active in ((DEEPSEEK_V2, 236, 21), (DEEPSEEK_V3, 671, 37)):
        activated = m.body_params(active=True) + 2 * m.head_params + m.hidden_size
        assert activated / 1e9 == pytest.approx(active, rel=0.04) and m.param_count / 1e9 == pytest.approx(total, rel=0.002)


def test_small_deepseek_and_qwen2_modules_count_like_the_shape():
    """Real (CPU) modules of small MLA/MoE and biased-qkv configs: every formula term is exercised exactly."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, \
        Qwen2Config, Qwen2ForCausalLM

    mla = dict(vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=4, num_experts_per_tok=2,
               kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=10,
               first_k_dense_replace=1, n_group=1, topk_group=1)
    models = [DeepseekV3ForCausalLM(DeepseekV3Config(**mla)), DeepseekV2ForCausalLM(DeepseekV2Config(**mla)),
              Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2))]
    for model in models:
        shape = ModelShape.from_hf_config(model.config)
        assert shape.param_count == sum(p.numel() for p in model.parameters()), type(model).__name__
    assert ModelShape.from_hf_config(models[0].config).kv_bytes_per_token(2) == 3 * (16 + 8) * 2


def test_attention_kind():
    assert [m.attention for m in KV_SIZING_PRESETS] == ["GQA", "GQA", "GQA", "GQA", "MLA", "MLA", "GQA"]
    assert ModelShape("mha", 2, 64, 4, 4, 16, 128, 100).attention == "MHA"
    assert ModelShape("mqa", 2, 64, 4, 1, 16, 128, 100).attention == "MQA"


def test_max_batch_arithmetic():
    h100, h200 = hw.get_accelerator("H100-SXM").mem_bytes, hw.get_accelerator("H200").mem_bytes
    assert (h100, h200) == (80e9, 141e9)
    # Llama-3-8B in bf16 on an H100: (80e9 - 2 x 8,030,261,248) / (131,072 x 8192) = 59.5 sequences of 8K
    free = 80e9 - 2 * 8_030_261_248
    assert LLAMA3_8B.max_batch_in(h100, 8192) == math.floor(free / (131_072 * 8192)) == 59
    assert LLAMA3_8B.max_batch_in(h100, 32768) == 14 and LLAMA3_8B.max_batch_in(h100, 131072) == 3
    assert QWEN25_7B.max_batch_in(h200, 8192) == math.floor((141e9 - 2 * 7_615_616_512) / (57_344 * 8192)) == 267
    assert MISTRAL_7B.max_batch_in(h100, 8192, kv_bytes_per_elem=1) == math.floor((80e9 - 2 * 7_248_023_552) / (65_536 * 8192))
    # 70B in bf16 (141.1 GB) fits neither; DeepSeek's weights are hundreds of GB: nothing fits on one GPU
    for m in (LLAMA3_70B, DEEPSEEK_V2, DEEPSEEK_V3):
        assert m.max_batch_in(h200, 8192) == 0 == m.max_tokens_in(h200)
    assert LLAMA3_70B.max_batch_in(h200, 8192, bytes_per_param=1) == math.floor((141e9 - 70_553_706_496) / 2_684_354_560)
    for m in KV_SIZING_PRESETS:   # the same answer through the token count
        for n in (8192, 32768, 131072):
            assert m.max_batch_in(h200, n) == m.max_tokens_in(h200) // n


def test_kv_sizing_table():
    rows = {r["model"]: r for r in kv_sizing_table()}
    assert list(rows) == [m.name for m in KV_SIZING_PRESETS]
    r = rows["Llama-3-70B"]
    assert r["kv_bytes_per_token"] == 327_680 and r["kv_GB_8K"] == 2.684 and r["kv_GB_128K"] == 42.95
    assert r["max_batch_H100-SXM_8K"] == 0 == r["max_batch_H200_8K"]
    r = rows["Llama-3-8B"]
    assert (r["max_batch_H100-SXM_8K"], r["max_batch_H100-SXM_32K"], r["max_batch_H100-SXM_128K"]) == (59, 14, 3)
    assert rows["DeepSeek-V3"]["kv_heads"] == "latent 512+64" and rows["DeepSeek-V3"]["attention"] == "MLA"
    assert rows["SmolLM2-135M"]["max_batch_H200_32K"] == SMOLLM2_135M.max_batch_in(141e9, 32768)


def test_engine_sizes_its_cache_with_the_same_function():
    from llmso_lab.engine import LLM
    from llmso_lab.engine.cache_sizing import kv_cache_bytes_per_block
    from llmso_lab.models import tiny_llama

    model = tiny_llama(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2)   # head_dim 16
    per_block = hw.kv_cache_bytes(3, 2, 16, 4, num_tokens=8)
    assert kv_cache_bytes_per_block(model.config, 8, torch.float32) == per_block == 2 * 3 * 2 * 16 * 4 * 8
    assert kv_cache_bytes_per_block(model.config, 8, torch.bfloat16) == per_block // 2
    budget = 100 * per_block + per_block // 2
    llm = LLM(model, block_size=8, max_model_len=64, max_num_seqs=1000, kv_cache_memory_bytes=budget)
    assert llm.stats()["kv_blocks_total"] == 100 == budget // per_block
    runner = llm.model_runner   # the tensors it allocated: the blocks plus the null block
    allocated = runner.k_cache.nbytes + runner.v_cache.nbytes
    assert allocated == hw.kv_cache_bytes(3, 2, 16, 4, num_tokens=8 * (100 + 1))
    assert allocated == ModelShape.from_hf_config(model.config).kv_cache_bytes(8 * 101, bytes_per_elem=4)


@pytest.mark.slow
def test_engine_num_kv_blocks_for_smollm2_matches_the_function():
    from llmso_lab.engine import LLM
    from llmso_lab.models import load_model

    model, tok = load_model("smollm2-135m")
    budget = 256 * 2**20
    llm = LLM(model, tok, block_size=16, max_model_len=1024, max_num_seqs=1000, kv_cache_memory_bytes=budget)
    per_block = hw.kv_cache_bytes(30, 3, 64, 4, num_tokens=16)   # fp32: 30 layers x 3 KV heads x 64
    assert per_block == SMOLLM2_135M.kv_cache_bytes(16, bytes_per_elem=4) == 737_280
    assert llm.stats()["kv_blocks_total"] == budget // per_block == 364
    assert llm.model_runner.k_cache.nbytes + llm.model_runner.v_cache.nbytes == (364 + 1) * per_block


def test_lab00_exercise_disables_every_home_of_the_formula():
    """While `kv_bytes_per_token` is graded, no other library route to the same number works."""
    from llmso_lab.engine.cache_sizing import kv_cache_bytes_per_block
    from llmso_lab.grading.registry import get_exercise
    from llmso_lab.grading.tripwire import tripwire
    from llmso_lab.models import tiny_llama

    ex, cfg = get_exercise("kv_bytes_per_token"), tiny_llama().config
    routes = [lambda: hw.kv_cache_bytes(80, 8, 128, 2, 1), lambda: hw.mla_kv_bytes_per_token(80, 2048, 0, 2),
              lambda: hw.mla_kv_cache_bytes(80, 2048, 0, 2, 1), lambda: LLAMA3_70B.kv_bytes_per_token(2),
              lambda: LLAMA3_70B.kv_cache_bytes(1), lambda: kv_cache_bytes_per_block(cfg, 1, torch.float16)]
    with tripwire(ex.disabled, ex.key):
        for route in routes:
            with pytest.raises(RuntimeError, match="TRIPWIRE"):
                route()
    assert [route() for route in routes[:5]] == [327_680] * 5


def test_kv_cache_bytes_of_a_hf_config_dict():
    llama70 = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192}
    assert hw.kv_cache_bytes_of_config(llama70, 1) == 327_680
    assert hw.kv_cache_bytes_of_config({**llama70, "head_dim": 128}, 8192, batch=4) == 4 * 8192 * 327_680
    assert hw.kv_cache_bytes_of_config({**llama70, "num_key_value_heads": None}, 1) == 8 * 327_680   # MHA
    v3 = {"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168,
          "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert hw.kv_cache_bytes_of_config(v3, 1) == 70_272 == DEEPSEEK_V3.kv_bytes_per_token(2)
    from llmso_lab.models import load_model
    smol = load_model("smollm2-135m")[0].config.to_dict()
    assert hw.kv_cache_bytes_of_config(smol, 100, dtype_bytes=4) == SMOLLM2_135M.kv_cache_bytes(100, 1, 4)
