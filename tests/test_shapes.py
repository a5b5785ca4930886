"""Model shapes: parameter counts, KV bytes and FLOPs against hand formulas and real HF models."""
import pytest

from llmso_lab.models.shapes import LLAMA2_70B, LLAMA3_70B, LLAMA3_8B, SMOLLM2_135M, ModelShape


def test_smollm2_param_count_by_hand():
    h, kv, inter, vocab, layers = 576, 3 * 64, 1536, 49152, 30
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * inter + 2 * h   # q, k+v, o, SwiGLU, two norms
    expected = vocab * h + layers * per_layer + h                     # tied head: embedding counted once
    assert SMOLLM2_135M.param_count == expected == 134_515_008
    assert SMOLLM2_135M.weight_bytes(4) == pytest.approx(538e6, rel=1e-3)  # the "538 MB of fp32"


def test_large_presets():
    assert LLAMA3_70B.param_count / 1e9 == pytest.approx(70.55, abs=0.01)
    assert LLAMA2_70B.param_count / 1e9 == pytest.approx(68.98, abs=0.01)  # Llama 2's vocab is 32000
    assert LLAMA3_8B.param_count / 1e9 == pytest.approx(8.03, abs=0.01)


def test_70b_kv_bytes_match_the_lecture():
    per_token = LLAMA3_70B.kv_bytes_per_token(2)
    assert per_token == 2 * 80 * 8 * 128 * 2 == 327_680       # 320 KiB
    assert 8192 * per_token / 1e9 == pytest.approx(2.6, abs=0.1)   # "8K prompt ~2.6 GB"
    assert 8192 * per_token / 50e9 == pytest.approx(0.05, rel=0.1)  # "~50 ms at 50 GB/s"
    assert LLAMA3_70B.kv_bytes_per_token(1) == per_token // 2


def test_flops_per_token_by_hand():
    m = SMOLLM2_135M
    matmul = 30 * (576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536) + 49152 * 576
    assert m.flops_per_token(0) == 2 * matmul
    assert m.flops_per_token(1000) - m.flops_per_token(0) == 4 * 30 * 9 * 64 * 1000


def test_from_hf_config_matches_real_models():
    from llmso_lab.models import tiny_llama, tiny_mixtral
    for model in (tiny_llama(), tiny_mixtral()):
        shape = ModelShape.from_hf_config(model.config)
        assert shape.param_count == sum(p.numel() for p in model.parameters())
    d = {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
         "intermediate_size": 28672, "vocab_size": 128256}
    assert ModelShape.from_hf_config(d).param_count == LLAMA3_70B.param_count


def test_moe_reads_only_touched_experts():
    from llmso_lab.models import tiny_mixtral
    moe = ModelShape.from_hf_config(tiny_mixtral(num_experts=8, experts_per_token=2).config)
    one, many = moe.weight_bytes_read(1), moe.weight_bytes_read(10_000)
    assert many == pytest.approx(moe.weight_bytes())
    unused = 6 * moe.expert_params * moe.num_layers * 2
    assert one == pytest.approx(moe.weight_bytes() - unused)
    assert moe.flops_per_token() < 2 * moe.param_count + 2 * moe.head_params  # only 2 of 8 experts active
