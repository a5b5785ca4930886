"""AWQ folded into the model (how the engine serves it): the fp32 model computes the same function, and RTN of the
folded weights is AWQ's quantization, which the engine's int4 kernels then run."""
import pytest
import torch

from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.engine.hf_reference import hf_greedy
from llmso_lab.models import tiny_llama
from llmso_lab.quant.awq import awq_best_scales, awq_fold_for_engine, awq_search
from llmso_lab.quant.weight_only import dequantized_copy


def test_folding_preserves_the_function():
    model = tiny_llama(hidden_size=128, intermediate_size=256)
    ids = torch.tensor([list(range(3, 60))])
    with torch.no_grad():
        before = model(ids).logits
    folded = awq_fold_for_engine(model, list(range(5, 200)), bits=4, group_size=32)
    with torch.no_grad():
        torch.testing.assert_close(folded(ids).logits, before, atol=1e-4, rtol=1e-4)
    norm = folded.model.layers[0].input_layernorm.weight
    assert not torch.allclose(norm, torch.ones_like(norm)), "no scale was folded into the norm"


def test_engine_serves_the_folded_model_like_hf_on_its_dequantized_weights():
    model = awq_fold_for_engine(tiny_llama(hidden_size=128, intermediate_size=256), list(range(5, 200)), 4, 32)
    ref = dequantized_copy(model, "int4", 32)
    llm = LLM(model, max_model_len=64, quantization="int4")
    prompt = [9, 8, 7, 6, 5, 4]
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert got[0].outputs[0].token_ids == hf_greedy(ref, prompt, 10)


def test_awq_best_scales_is_the_symmetric_search():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 32, generator=g), torch.randn(40, 32, generator=g)
    x[:, 3] *= 20
    torch.testing.assert_close(awq_best_scales(w, x, 4, 16, 10), awq_search(w, x, 4, 16, True, 10).scales)
