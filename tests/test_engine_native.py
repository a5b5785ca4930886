"""The optional native GEMV (`engine.native`, opt-in with LLMSO_LAB_NATIVE_GEMV=1): the kernel against torch, the
routing of few rows to it and many rows to the engine's usual kernel, the engine's greedy tokens equal to Hugging
Face's with it, and the fallback where it cannot be built. The first test compiles it (~25 s, once per machine)."""
from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from llmso_lab import hardware as hw
from llmso_lab.engine import native

BUILDABLE = ("avx512f" in hw.cpu_flags() and shutil.which("ninja") is not None
             and (shutil.which("c++") or shutil.which("g++")) is not None)


def test_load_builds_here_or_says_why():
    mod, why = native.load()
    if BUILDABLE:   # this machine kind (AVX-512, g++, ninja) must get the kernel
        assert mod is not None, why
        assert why.startswith("native GEMV built for fp32")
    else:
        assert mod is None and ("AVX-512" in why or "could not be built" in why or "x86-64" in why)


def _module():
    mod, why = native.load()
    assert mod is not None or not BUILDABLE, why
    return mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch(dtype):
    mod = _module()
    if mod is None or (dtype == torch.bfloat16 and not mod.has_bf16()):
        assert not native.supports(torch.zeros(64, 8, dtype=dtype))   # the engine then never routes here
        return
    g = torch.Generator().manual_seed(0)
    for m in (1, 2, 3, 8):
        for n, k in ((3072, 576), (577, 1536), (5, 64)):   # a tail of 1 and of 1 row past the groups of 4
            w = torch.randn(n, k, generator=g).to(dtype)
            x = torch.randn(m, k, generator=g).to(dtype)
            ref = x.double() @ w.double().t()
            got = mod.gemv(x, w)
            assert got.dtype == dtype and got.shape == (m, n)
            # fp32: only the summation order differs; bf16: one rounding of the fp32 sum to bf16
            tol = 1e-5 if dtype == torch.float32 else 8e-3
            assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < tol


def test_kernel_refuses_bad_shapes():
    mod = _module()
    if mod is None:
        return
    with pytest.raises(RuntimeError, match="multiple of 16"):
        mod.gemv(torch.randn(1, 24), torch.randn(4, 24))
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and w \\[N, K\\]"):
        mod.gemv(torch.randn(1, 32), torch.randn(4, 48))
    assert not native.supports(torch.randn(24, 4))      # the engine sends such a weight to its usual kernel


def test_few_rows_go_native_many_rows_go_to_the_usual_kernel(monkeypatch):
    mod = _module()
    if mod is None:
        return
    w_t = torch.randn(64, 40)              # engine layout [in, out]
    calls = []
    big = lambda x: calls.append(x.shape[0]) or x @ w_t  # noqa: E731
    lin = native.NativeGemvLinear(w_t, big)
    for rows in (1, native.MAX_ROWS[torch.float32], native.MAX_ROWS[torch.float32] + 1, 64):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(lin(x), x @ w_t, rtol=1e-5, atol=1e-5)
    assert calls == [native.MAX_ROWS[torch.float32] + 1, 64]
    assert lin.nbytes == w_t.numel() * 4 and lin.in_features == 64


def test_engine_with_native_gemv_matches_hf_and_is_opt_in(monkeypatch):
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.engine.hf_reference import hf_greedy
    from llmso_lab.models.tiny import tiny_llama

    model = tiny_llama(num_layers=2, hidden_size=64)
    prompts = [[5, 17, 99, 3], [42] * 9, list(range(30, 50))]
    want = [hf_greedy(model, p, 12) for p in prompts]
    monkeypatch.delenv(native.ENV, raising=False)
    plain = LLM(model, None, dtype="float32", max_num_seqs=4, max_model_len=128)
    assert not isinstance(plain.model_runner.layers[0].gate_up, native.NativeGemvLinear)   # off by default
    with native.enabled():
        llm = LLM(model, None, dtype="float32", max_num_seqs=4, max_model_len=128)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)]
    assert got == want
    kind = type(llm.model_runner.layers[0].gate_up)
    assert (kind is native.NativeGemvLinear) == BUILDABLE


def test_engine_falls_back_with_a_warning_where_it_cannot_be_built(monkeypatch):
    from llmso_lab.engine import LLM
    from llmso_lab.models.tiny import tiny_llama

    monkeypatch.setattr(native, "load", lambda: (None, "the native GEMV needs AVX-512 (this CPU has none)"))
    with native.enabled(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(tiny_llama(), None, dtype="float32", max_num_seqs=2, max_model_len=64)
    assert any("LLMSO_LAB_NATIVE_GEMV=1: the native GEMV needs AVX-512" in str(w.message) for w in caught)
    assert not isinstance(llm.model_runner.layers[0].gate_up, native.NativeGemvLinear)
