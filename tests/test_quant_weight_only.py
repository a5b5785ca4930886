"""Weight-only quantized matmuls (W8A16 / W4A16): the CPU kernels and the Triton kernel equal dequantize-then-matmul,
and the engine with `quantization=` generates what Hugging Face generates on the same dequantized weights."""
from __future__ import annotations

import pytest
import torch

from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.engine.config import parse_quantization
from llmso_lab.engine.hf_reference import hf_greedy
from llmso_lab.models import tiny_llama
from llmso_lab.quant import quantize
from llmso_lab.quant.triton_w4a16 import w4a16_matmul, w4a16_reference
from llmso_lab.quant.weight_only import (WeightOnlyInt4, WeightOnlyInt8, dequantized_copy, quantize_model_weight_only,
                                         quantize_weight)

BF16_REL = 2.0 ** -8   # bf16 keeps 8 significant bits: the kernels take bf16 activations and return bf16


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method,group", [("int8", 0), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("rows", [1, 7])
def test_cpu_kernels_equal_dequantize_then_matmul_on_bf16_inputs(method, group, rows):
    w, x = _rand(96, 192) * 0.05, _rand(rows, 192, seed=1)
    kernel = quantize_weight(w, method, group_size=group or 32)
    y = kernel(x)
    assert y.shape == (rows, 96) and y.dtype == torch.float32
    ref = x.to(torch.bfloat16).float() @ kernel.dequantize().t()      # the kernel sees bf16 x and bf16 scales
    torch.testing.assert_close(y, ref, atol=2e-3, rtol=2 * BF16_REL)   # its output is rounded to bf16
    # and the dequantized weight is the RTN grid of the scheme, up to the kernel's bf16 scale (and int4's bf16 zero
    # point, minimum + 8 * scale: a shift of up to half a bf16 ulp of it for the whole group)
    expected = quantize(w, 8) if method == "int8" else quantize(w, 4, group_size=group, symmetric=False)
    torch.testing.assert_close(kernel.dequantize(), expected.dequantize(), atol=BF16_REL * w.abs().max().item(), rtol=0)


def test_storage_is_packed():
    w = _rand(64, 128)
    assert WeightOnlyInt8(w).nbytes == 64 * 128 + 2 * 64
    assert WeightOnlyInt4(w, group_size=32).nbytes == 64 * 128 // 2 + 2 * 2 * 64 * 4


@pytest.mark.parametrize("m,n,k,g,dtype", [(1, 96, 128, 32, torch.float32), (5, 70, 192, 64, torch.float32),
                                           (3, 40, 256, 128, torch.float32), (17, 64, 64, 32, torch.float16)])
def test_triton_w4a16_equals_dequantize_then_matmul(m, n, k, g, dtype):
    qt = quantize(_rand(n, k), 4, group_size=g, symmetric=False)
    x = _rand(m, k, seed=2).to(dtype)
    y = w4a16_matmul(x, qt.packed, qt.scale.to(dtype), qt.minimum.to(dtype), g)
    want = w4a16_reference(x, qt.packed, qt.scale.to(dtype), qt.minimum.to(dtype), g)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), want.float(), atol=tol, rtol=tol)
    if dtype == torch.float32:   # and that is x @ dequantize(W)^T
        torch.testing.assert_close(y, x @ qt.dequantize().t(), atol=1e-4, rtol=1e-5)


def test_triton_w4a16_rejects_bad_shapes():
    qt = quantize(_rand(8, 64), 4, group_size=32, symmetric=False)
    with pytest.raises(ValueError, match="shapes do not agree"):
        w4a16_matmul(_rand(1, 32), qt.packed, qt.scale, qt.minimum, 32)


def test_gpu_bench_w4a16_code_path_dry_runs_on_cpu():
    """`make gpu-bench` also runs `bench w4a16`; its code runs here on a tiny shape under the interpreter."""
    from llmso_lab.bench.w4a16 import kernel_rows
    rows, ratios = kernel_rows(torch.device("cpu"), {"tiny": (48, 64)}, [1, 3], group_size=32)
    assert len(rows) == 2 and all(r["max_err"] < 1e-4 for r in rows) and set(ratios) == {
        "w4a16_over_fp16_speed_tiny_m1", "w4a16_over_fp16_speed_tiny_m3"}


@pytest.mark.parametrize("spec,want", [("int8", ("int8", 0)), ("int4", ("int4", 32)), ("int4-g64", ("int4", 64))])
def test_parse_quantization(spec, want):
    assert parse_quantization(spec) == want


@pytest.mark.parametrize("bad", ["int3", "fp8", "int4-g48", "int8-g32", "int4-gx"])
def test_bad_quantization_says_what_is_valid(bad):
    with pytest.raises(ValueError, match="valid"):
        LLM(tiny_llama(), max_model_len=64, quantization=bad)


PROMPTS = [[42], [9, 8, 7, 6, 5, 4], [17, 99, 4, 250, 31, 8, 77, 120, 5, 66, 201, 3, 14, 15], list(range(3, 40))]


def first_divergence_is_near_tie(ref_model, prompt, want, have, rel=4 * 2.0 ** -8):
    """Where two greedy continuations part, the reference's logits of the two tokens must be within `rel`
    (relative; bf16 activations round each matmul input to 8 bits). Returns the position (None: equal)."""
    first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), None)
    if first is None:
        return None
    with torch.no_grad():
        logits = ref_model(torch.tensor([prompt + want[:first]])).logits[0, -1]
    a, b = logits[want[first]].item(), logits[have[first]].item()
    assert abs(a - b) <= rel * max(abs(a), abs(b)), f"parted at token {first} where one token clearly wins: {a:.4f} vs {b:.4f}"
    return first


@pytest.mark.parametrize("spec", ["int8", "int4", "int4-g64"])
def test_quantized_engine_generates_what_hf_generates_on_the_dequantized_weights(spec):
    model = tiny_llama(hidden_size=128, intermediate_size=256)
    method, group = parse_quantization(spec)
    ref = dequantized_copy(model, method, group)
    llm = LLM(model, max_model_len=64, quantization=spec)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    parted = [first_divergence_is_near_tie(ref, p, hf_greedy(ref, p, 12), o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)]
    assert parted.count(None) >= 3, parted   # measured: all four equal
    # the engine really multiplies by packed weights, and the HF module is untouched
    assert type(llm.model_runner.layers[0].attn.qkv).__name__ == ("WeightOnlyInt8" if method == "int8" else "WeightOnlyInt4")
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)


def test_quantized_hf_model_runs_the_kernels_arithmetic():
    """quantize_model_weight_only puts the kernels into an HF model (used for perplexity). Its logits equal the
    dequantized fp32 model's with every Linear's input and output rounded to bf16, as the kernels do."""
    model = tiny_llama(hidden_size=128, intermediate_size=256)
    ref = dequantized_copy(model, "int4", 32)
    for lin in (m for m in ref.modules() if isinstance(m, torch.nn.Linear)):
        lin.register_forward_pre_hook(lambda mod, args: (args[0].to(torch.bfloat16).float(),))
        lin.register_forward_hook(lambda mod, args, out: out.to(torch.bfloat16).float())
    quantize_model_weight_only(model, "int4", 32)
    ids = torch.tensor([PROMPTS[3]])
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert ((got - want).norm() / want.norm()).item() < 2e-3
    assert type(model.lm_head).__name__ == "WeightOnlyLinear" and type(model.model.embed_tokens).__name__ == "Embedding"


def test_mla_with_quantization_is_refused():
    from llmso_lab.models import tiny_deepseek_v3
    with pytest.raises(ValueError, match="not MLA"):
        LLM(tiny_deepseek_v3(), max_model_len=64, quantization="int8")


@pytest.mark.slow
def test_smollm2_int8_engine_greedy_equals_hf_on_dequantized_weights_except_near_ties():
    """The issue's check on the real model: int8 greedy tokens equal those of the same model with dequantized fp32
    weights run by Hugging Face, except where the two top tokens are a near-tie (the kernel rounds activations
    to bf16), checked by `first_divergence_is_near_tie`."""
    from llmso_lab.bench.quant import chat_prompts
    from llmso_lab.models import load_model
    model, tok = load_model("smollm2-135m")
    prompts = chat_prompts(tok, 2)
    ref = dequantized_copy(model, "int8")
    llm = LLM(model, tok, max_model_len=256, quantization="int8")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    parted = [first_divergence_is_near_tie(ref, p, hf_greedy(ref, p, 16), o.outputs[0].token_ids)
              for p, o in zip(prompts, outs)]
    assert parted.count(None) >= 1, parted
