"""The optional native path (`engine.native`, opt-in with LLMSO_LAB_NATIVE=1): the packed kernel against torch and
its routing of rows to it or to the engine's usual kernel; the whole forward step (fp32 greedy tokens equal Hugging
Face's with prefills, chunked prefills and prefix hits in C++ too, logits equal the torch path's on the same cache for
decode and mixed batches, int4 against the torch int4 path and the dequantized weights, what it refuses and what it
leaves to torch); the paged decode attention against SDPA; the fallback where it cannot be built. The first test
compiles it (~30 s, once per machine and source)."""
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
        assert why.startswith("native path built for fp32")
    else:
        assert mod is None and ("AVX-512" in why or "could not be built" in why or "x86-64" in why)


def _module():
    mod, why = native.load()
    assert mod is not None or not BUILDABLE, why
    return mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch(dtype):
    """`gemm(x, pack(w), N)` against float64: row counts around the tile (12) and the chunk of x (96), outputs with
    a tail past the blocks of 32, odd K in fp32."""
    mod = _module()
    if mod is None or (dtype == torch.bfloat16 and not mod.has_bf16()):
        assert not native.supports(torch.zeros(64, 8, dtype=dtype))   # the engine then never routes here
        return
    g = torch.Generator().manual_seed(0)
    shapes = ((3072, 576), (577, 1536), (5, 64), (40, 2)) + (((33, 37),) if dtype == torch.float32 else ())
    for m in (1, 3, 12, 13, 97):
        for n, k in shapes:
            w = torch.randn(n, k, generator=g).to(dtype)
            x = torch.randn(m, k, generator=g).to(dtype)
            ref = x.double() @ w.double().t()
            got = mod.gemm(x, mod.pack(w), n)
            assert got.dtype == dtype and got.shape == (m, n)
            # fp32: only the summation order differs; bf16: one rounding of the fp32 sum to bf16
            tol = 1e-5 if dtype == torch.float32 else 8e-3
            assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < tol, (m, n, k)


def test_kernel_refuses_bad_shapes():
    mod = _module()
    if mod is None:
        return
    with pytest.raises(RuntimeError, match="even number of inputs"):
        mod.pack(torch.randn(4, 25).bfloat16())
    with pytest.raises(RuntimeError, match="must be `pack\\(w\\)` of a \\[4, 48\\] weight"):
        mod.gemm(torch.randn(1, 48), mod.pack(torch.randn(4, 32)), 4)
    with pytest.raises(RuntimeError, match="of x's dtype"):
        mod.gemm(torch.randn(1, 32), mod.pack(torch.randn(4, 32).double().float().bfloat16()), 4)
    assert not native.supports(torch.randn(25, 4).bfloat16())   # the engine sends such a weight to its usual kernel


def test_rows_go_native_up_to_max_rows_then_to_the_usual_kernel():
    mod = _module()
    if mod is None:
        return
    w_t = torch.randn(64, 40)              # engine layout [in, out]
    calls = []
    big = lambda x: calls.append(x.shape[0]) or x @ w_t  # noqa: E731
    lin = native.NativeLinear(w_t, big)
    assert lin.max_rows == native.MAX_ROWS[torch.float32]
    lin.max_rows = 8
    for rows in (1, 8, 9, 64):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(lin(x), x @ w_t, rtol=1e-5, atol=1e-5)
    assert calls == [9, 64]
    assert lin.nbytes == 64 * 64 * 4 and lin.in_features == 64 and lin.out_features == 40   # 40 outputs padded to 64


def test_engine_with_native_kernel_matches_hf_and_is_opt_in(monkeypatch):
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.engine.hf_reference import hf_greedy
    from llmso_lab.models.tiny import tiny_llama

    model = tiny_llama(num_layers=2, hidden_size=64)
    prompts = [[5, 17, 99, 3], [42] * 9, list(range(30, 50))]
    want = [hf_greedy(model, p, 12) for p in prompts]
    monkeypatch.delenv(native.ENV, raising=False)
    plain = LLM(model, None, dtype="float32", max_num_seqs=4, max_model_len=128)
    assert not isinstance(plain.model_runner.layers[0].gate_up, native.NativeLinear)   # off by default
    with native.enabled():
        llm = LLM(model, None, dtype="float32", max_num_seqs=4, max_model_len=128)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)]
    assert got == want
    kind = type(llm.model_runner.layers[0].gate_up)
    assert (kind is native.NativeLinear) == BUILDABLE


def test_engine_falls_back_with_a_warning_where_it_cannot_be_built(monkeypatch):
    from llmso_lab.engine import LLM
    from llmso_lab.models.tiny import tiny_llama

    monkeypatch.setattr(native, "load", lambda: (None, "the native path needs AVX-512 (this CPU has none)"))
    with native.enabled(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(tiny_llama(), None, dtype="float32", max_num_seqs=2, max_model_len=64)
    assert any("LLMSO_LAB_NATIVE=1: the native path needs AVX-512" in str(w.message) for w in caught)
    assert not isinstance(llm.model_runner.layers[0].gate_up, native.NativeLinear)


# ---- the whole forward step in C++ (`native.NativeStep`) -----------------------------------------------------------

def _tokens(llm, prompts, n=12):
    """Greedy tokens for each prompt: n per prompt, or n[i] for prompt i."""
    from llmso_lab.engine import SamplingParams
    ns = n if isinstance(n, (list, tuple)) else [n] * len(prompts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=k, ignore_eos=True) for k in ns], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _native_llm(model, **kw):
    from llmso_lab.engine import LLM
    with native.enabled():
        llm = LLM(model, None, **kw)
    assert (llm.model_runner.native_step is not None) == BUILDABLE, native.NativeStep.unsupported(llm.model_runner)
    return llm


@pytest.mark.parametrize("batch", [1, 3])
def test_native_step_greedy_equals_hf_fp32(batch):
    """fp32: every step (the prefill and each decode) runs in C++ (one call), and the tokens equal Hugging Face's.
    Prompts cross block boundaries (block_size 16) so attention reads through the block table."""
    from llmso_lab.engine.hf_reference import hf_greedy
    from llmso_lab.models.tiny import tiny_llama

    model = tiny_llama(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2)
    prompts = [[5, 17, 99, 3], list(range(30, 58)), [42] * 9][:batch]
    llm = _native_llm(model, dtype="float32", max_num_seqs=4, max_model_len=128, block_size=16)
    assert _tokens(llm, prompts, 24) == [hf_greedy(model, p, 24) for p in prompts]
    if BUILDABLE:   # one prefill step, 23 decode steps
        assert llm.model_runner.native_step.num_steps == llm.model_runner.num_forwards == 24


def test_native_step_chunked_prefill_and_prefix_hits_equal_hf_fp32():
    """Prefills cut into chunks (max_num_batched_tokens 24) batched with decodes, and prompts that hit the prefix
    cache (their first blocks already computed): every step in C++, tokens equal Hugging Face's."""
    from llmso_lab.engine.hf_reference import hf_greedy
    from llmso_lab.models.tiny import tiny_llama

    model = tiny_llama(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    shared = list(range(40, 80))
    prompts = [shared + [3, 4], list(range(100, 161)), shared + [9], [7, 8, 9]]
    llm = _native_llm(model, dtype="float32", max_num_seqs=4, max_model_len=128, block_size=16,
                      max_num_batched_tokens=24, enable_chunked_prefill=True, enable_prefix_caching=True)
    assert _tokens(llm, prompts, 10) == [hf_greedy(model, p, 10) for p in prompts]
    assert _tokens(llm, prompts[:1], 10) == [hf_greedy(model, prompts[0], 10)]   # 32 of its 42 tokens cached
    if BUILDABLE:
        assert llm.model_runner.native_step.num_steps == llm.model_runner.num_forwards


@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "decode+prefill-chunk"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_step_logits_match_the_torch_path(dtype, mixed):
    """The same batch through the C++ step and through torch, on the same runner and cache: two decodes, or two
    decodes and a 20-token prefill chunk on top of 5 cached tokens (it attends to them and causally to itself; logits
    at its last 2 tokens). fp32 equal up to summation order; bf16 within a few bf16 roundings (both round where torch
    rounds), same argmax."""
    from llmso_lab.models.tiny import tiny_llama

    mod = _module()
    if mod is None or (dtype == "bfloat16" and not mod.has_bf16()):
        return
    model = tiny_llama(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, initializer_range=0.05)
    llm = _native_llm(model, dtype=dtype, max_num_seqs=2, max_model_len=128, block_size=16)
    runner = llm.model_runner
    _tokens(llm, [list(range(3, 40)), [7] * 20], 2)   # fill the cache: 38 and 21 tokens
    from llmso_lab.engine.model_runner import BatchRow
    rows = [BatchRow([11], 38, [0, 1, 2]), BatchRow([12], 21, [3, 4])]
    if mixed:   # blocks 5, 6 hold no one's tokens: take the first 5 as cached, compute 20 more
        rows.append(BatchRow(list(range(60, 80)), 5, [5, 6], num_logits=2))
    args = runner.prepare_rows(rows, num_decodes=2)
    # (the blocks above are the ones the two finished sequences used; their cache content is what decode reads)
    step, runner.native_step = runner.native_step, None
    want, want_hidden = runner.forward(*args), runner.last_hidden
    runner.native_step = step
    got = runner.forward(*args)
    assert got.dtype == torch.float32 and got.shape == want.shape
    if dtype == "float32":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(runner.last_hidden, want_hidden, rtol=1e-4, atol=1e-4)
    else:
        assert ((got - want).abs().max() / want.abs().max()).item() < 0.03
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert runner.last_hidden.dtype == torch.bfloat16


def test_native_step_leaves_padded_steps_hooks_and_other_runners_to_torch():
    """Any batch of real tokens runs in C++ (here 10 sequences); a lock-step batch's padded prefill and idle rows and a
    runner with a hook go through torch (tokens still equal HF's); an unsupported runner gets no step."""
    from llmso_lab.engine import LLM
    from llmso_lab.engine.hf_reference import hf_greedy
    from llmso_lab.models.tiny import tiny_llama

    if not BUILDABLE:
        return
    model = tiny_llama(num_layers=2, hidden_size=64)
    prompts = [[i, i + 1, i + 2] for i in range(10, 20)]
    llm = _native_llm(model, dtype="float32", max_num_seqs=10, max_model_len=64)
    assert _tokens(llm, prompts, 6) == [hf_greedy(model, p, 6) for p in prompts]
    assert llm.model_runner.native_step.num_steps == llm.model_runner.num_forwards == 6
    with native.enabled():   # static batching: prompts padded to the longest, finished rows idle
        static = LLM(model, None, dtype="float32", max_num_seqs=4, max_model_len=64, batching="static")
    ragged = [[5, 6], list(range(20, 29)), [7, 8, 9]]
    assert _tokens(static, ragged, [3, 8, 5]) == [hf_greedy(model, p, n) for p, n in zip(ragged, (3, 8, 5))]
    runner = static.model_runner
    assert 0 < runner.native_step.num_steps < runner.num_forwards   # the padded prefill and idle-row steps in torch
    hooked = _native_llm(model, dtype="float32", max_num_seqs=2, max_model_len=64)
    hooked.model_runner.kv_hook = lambda i: None
    assert _tokens(hooked, prompts[:1], 6) == [hf_greedy(model, prompts[0], 6)]
    assert hooked.model_runner.native_step.num_steps == 0
    for kw, why in ((dict(attention_backend="triton"), "runs its own kernels"),
                    (dict(kv_cache_dtype="int8"), "plain paged KV cache")):
        with native.enabled():
            llm = LLM(model, None, dtype="float32", max_num_seqs=2, max_model_len=64, **kw)
        assert llm.model_runner.native_step is None
        assert why in native.NativeStep.unsupported(llm.model_runner)
    with native.enabled():
        odd = LLM(tiny_llama(intermediate_size=80), None, dtype="float32", max_num_seqs=2, max_model_len=64)
    assert odd.model_runner.native_step is None
    assert "not a multiple of 32" in native.NativeStep.unsupported(odd.model_runner)
    with native.enabled(False):
        assert LLM(model, None, dtype="float32", max_num_seqs=2, max_model_len=64).model_runner.native_step is None


def test_native_step_refuses_bad_input_clearly():
    mod = _module()
    if mod is None:
        return
    from llmso_lab.models.tiny import tiny_llama

    llm = _native_llm(tiny_llama(), dtype="float32", max_num_seqs=2, max_model_len=64, block_size=16)
    step = llm.model_runner.native_step.step
    i64, i32 = dict(dtype=torch.int64), dict(dtype=torch.int32)
    # one token (id 5, position 0, slot 0) of one sequence with block table [0, 0, 0, 0], 1 key, logits at token 0
    ok = (torch.tensor([5], **i64), torch.tensor([0], **i64), torch.tensor([0], **i64), torch.zeros(1, 4, **i32),
          torch.tensor([1], **i32), torch.tensor([0, 1], **i32), torch.tensor([0], **i64))

    def bad(i, value, match):
        args = list(ok)
        args[i] = value
        with pytest.raises(RuntimeError, match=match):
            step.run(*args)

    logits, hidden = step.run(*ok)
    assert logits.shape == (1, 256) and hidden.shape == (1, 64)
    bad(0, torch.tensor([10 ** 6], **i64), "outside the vocabulary")
    bad(1, torch.tensor([10 ** 6], **i64), "past the RoPE table")
    bad(4, torch.tensor([65], **i32), "a context of 65 .*the block table.s slots")
    bad(4, torch.tensor([0], **i32), "new tokens and a context of 0")
    bad(3, torch.zeros(1, 4, **i64), "int32")
    bad(2, torch.tensor([10 ** 9], **i64), "is not a slot of the cache")
    bad(3, torch.tensor([[10 ** 6, 0, 0, 0]], **i32), "is not a block of the cache")
    bad(5, torch.tensor([0, 2], **i32), "cu_q must run from 0 to the number of tokens 1")
    bad(6, torch.tensor([1], **i64), "logits index 1 is not a token of the step")
    w = torch.zeros(3, 64)
    with pytest.raises(RuntimeError, match="10 tensors per layer"):
        mod.Step([w], torch.zeros(256, 64), torch.zeros(64), torch.zeros(256, 64), torch.empty(0), torch.zeros(8, 16),
                 torch.zeros(8, 16), [torch.zeros(2, 16, 2, 16)], [torch.zeros(2, 16, 2, 16)], 4, 2, 16, 256, 256,
                 1e-5, 0.25)


@pytest.mark.parametrize("hidden", [64, 256])
def test_native_step_int4_equals_the_torch_int4_path(hidden):
    """quantization="int4" (group 32): the step unpacks the same codes, bf16 scales and zeros as torch's int4 kernel
    and rounds where it rounds, so greedy tokens equal the torch path's (on these models: on SmolLM2 the two best
    bf16 logits often tie exactly). hidden 64 and 256: groups of 32 over 2 and 8 of them per output."""
    from llmso_lab.engine import LLM
    from llmso_lab.models.tiny import tiny_llama

    model = tiny_llama(num_layers=2, hidden_size=hidden, num_heads=4, num_kv_heads=2, initializer_range=0.05)
    prompts = [[5, 17, 99, 3], list(range(30, 60)), [(7 * i) % 250 + 3 for i in range(101)]]
    kw = dict(dtype="float32", quantization="int4", max_num_seqs=3, max_model_len=160)
    llm = _native_llm(model, **kw) if BUILDABLE else LLM(model, None, **kw)
    with native.enabled(False):
        plain = LLM(model, None, **kw)
    assert plain.model_runner.native_step is None
    for batch in ([prompts[0]], prompts):   # prefills of 4, 30, 101 tokens: tiles of 1-4 rows, a second chunk
        assert _tokens(llm, batch, 16) == _tokens(plain, batch, 16)
    if BUILDABLE:   # every step, prefills included
        assert llm.model_runner.native_step.num_steps == 32


def test_native_step_int4_logits_match_the_dequantized_weights():
    """An independent reference for the int4 kernel: the logits of a step (a decode and a 7-token chunk: tiles of 4
    and 3 rows) against the torch path run on the dequantized fp32 weights (what the codes, scales and zeros mean),
    within bf16 rounding of the matmul inputs."""
    mod = _module()
    if mod is None or not mod.has_bf16():
        return
    from llmso_lab.engine.model_runner import BatchRow
    from llmso_lab.models.tiny import tiny_llama

    model = tiny_llama(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, initializer_range=0.05)
    llm = _native_llm(model, dtype="float32", quantization="int4", max_num_seqs=1, max_model_len=64)
    runner = llm.model_runner
    _tokens(llm, [list(range(3, 30))], 1)
    rows = [BatchRow([11], 27, [0, 1]), BatchRow(list(range(40, 47)), 0, [2], num_logits=3)]
    args = runner.prepare_rows(rows, num_decodes=1)
    before = runner.native_step.num_steps
    got = runner.forward(*args)
    assert runner.native_step.num_steps == before + 1 and got.shape[0] == 4
    for w in runner.layers:   # the same runner on the weights the int4 codes stand for, through torch
        w.attn.qkv, w.attn.o = w.attn.qkv.dequantize().t(), w.attn.o.dequantize().t()
        w.gate_up, w.down = w.gate_up.dequantize().t(), w.down.dequantize().t()
    runner.lm_head, runner.native_step = runner.lm_head.dequantize().t(), None
    want = runner.forward(*args)
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.02
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("heads", [(6, 2, 64), (8, 2, 16), (4, 2, 128), (2, 1, 512)],
                         ids=["D64-G3", "D16-G4", "D128-G2", "D512-G2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_sdpa_on_gathered_blocks(dtype, heads):
    """The native path's decode attention for the torch backend: each row's keys read through its block table
    (blocks shuffled over the cache, contexts ending mid-block, GQA, a sliding window) against SDPA on the gathered
    keys; q as the runner hands it over, a strided view of the q/k projection. Head sizes from 16 to 512 cover the
    kernel's register layouts (up to 16 / (D / 16) query heads per pass over the keys, one pass per head at 512)."""
    import torch.nn.functional as F

    mod = _module()
    if mod is None or (dtype == torch.bfloat16 and not mod.has_bf16()):
        return
    g = torch.Generator().manual_seed(0)
    (H, Hkv, D), B, bs, nblocks = heads, 3, 16, 20
    kc = torch.randn(nblocks, bs, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(nblocks, bs, Hkv, D, generator=g).to(dtype)
    ctx = [37, 1, 64]
    perm = torch.randperm(nblocks, generator=g).tolist()
    tables = torch.tensor([perm[0:4], perm[4:8], perm[8:12]], dtype=torch.int32)
    qk = torch.randn(B, H + Hkv, D, generator=g).to(dtype)
    q = qk[:, :H]                                    # strided rows, as `LlamaAttention.project` returns q
    for window in (0, 5):
        got = mod.paged_decode(q, kc, vc, tables, torch.tensor(ctx, dtype=torch.int32), D ** -0.5, window)
        for b in range(B):
            keys = kc[tables[b].long()].reshape(-1, Hkv, D)[:ctx[b]]
            vals = vc[tables[b].long()].reshape(-1, Hkv, D)[:ctx[b]]
            if window:
                keys, vals = keys[-window:], vals[-window:]
            want = F.scaled_dot_product_attention(q[b, :, None].double(), keys.transpose(0, 1).double(),
                                                  vals.transpose(0, 1).double(), enable_gqa=True)[:, 0]
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got[b].double(), want, rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="does not fit the block table"):
        mod.paged_decode(q, kc, vc, tables, torch.tensor([65, 1, 1], dtype=torch.int32), 0.125, 0)
    with pytest.raises(RuntimeError, match="is not a block of the cache"):
        mod.paged_decode(q, kc, vc, tables + nblocks, torch.tensor(ctx, dtype=torch.int32), 0.125, 0)


def test_native_decode_attention_serves_batches_the_step_does_not_take():
    """Where the step does not apply (here a sliding-window model) the torch path runs, its decode attention through
    `paged_decode` (no gather): the tokens still equal Hugging Face's."""
    from transformers import MistralConfig, MistralForCausalLM

    from llmso_lab.engine.hf_reference import hf_greedy

    if not BUILDABLE:
        return
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(   # sliding window 7: the decode rows read only their last 7 keys
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, sliding_window=7, eos_token_id=2,
        bos_token_id=1, pad_token_id=0, attn_implementation="eager")).eval()
    prompts = [[i, i + 3, i + 5, i + 1] * 3 for i in range(10, 20)]
    from llmso_lab.engine import LLM
    with native.enabled():
        llm = LLM(model, None, dtype="float32", max_num_seqs=10, max_model_len=64, block_size=16)
    assert llm.model_runner.backend.native_decode is not None and llm.model_runner.native_step is None
    assert _tokens(llm, prompts, 10) == [hf_greedy(model, p, 10) for p in prompts]
