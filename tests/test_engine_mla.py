"""MLA (DeepSeek-V2/V3 attention): absorbed equals naive attention, and the engine serving a tiny DeepSeek-V3
over its latent paged cache gives Hugging Face's greedy tokens."""
from __future__ import annotations

import pytest
import torch

from llmso_lab.attention.mla import absorb_query, mla_attention, mla_decode_absorbed, mla_paged_decode_torch
from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.engine.hf_reference import hf_greedy
from llmso_lab.models import tiny_deepseek_v3, tiny_llama


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("T,S,causal", [(1, 1, True), (1, 37, True), (5, 37, True), (6, 6, True), (4, 9, False)])
def test_absorbed_mla_equals_naive(T, S, causal):
    H, dn, dr, dv, r = 4, 16, 8, 12, 32
    args = (rand(T, H, dn, seed=1), rand(T, H, dr, seed=2), rand(S, r, seed=3), rand(S, dr, seed=4),
            rand(H, dn, r, seed=5) / 4, rand(H, dv, r, seed=6) / 4)
    naive, absorbed = mla_attention(*args, scale=0.2, causal=causal), mla_decode_absorbed(*args, scale=0.2, causal=causal)
    assert absorbed.shape == (T, H, dv)
    torch.testing.assert_close(absorbed, naive, atol=1e-5, rtol=1e-5)


def prompts(lengths=(5, 17, 33)):
    return [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


MODELS = {"interleaved-rope": dict(), "q-lora": dict(q_lora_rank=24, seed=1), "plain-rope": dict(rope_interleave=False, seed=3)}
ENGINES = {"continuous": dict(), "chunked-prefix-cache": dict(enable_prefix_caching=True, max_num_batched_tokens=16, block_size=4),
           "static": dict(batching="static"), "preempt-swap": dict(num_kv_blocks=6, block_size=4, max_num_seqs=3,
                                                                    preemption_mode="swap", max_model_len=24)}


@pytest.mark.parametrize("model_kw", MODELS.values(), ids=MODELS.keys())
@pytest.mark.parametrize("engine_kw", ENGINES.values(), ids=ENGINES.keys())
def test_engine_serves_mla_with_hf_greedy_tokens(model_kw, engine_kw):
    model = tiny_deepseek_v3(**model_kw)
    ps = prompts((5, 9, 13) if "preemption_mode" in engine_kw else (5, 17, 33))
    expected = [hf_greedy(model, p, 6) for p in ps]
    llm = LLM(model, **{"max_model_len": 128, **engine_kw})
    outs = llm.generate(ps, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if "preemption_mode" in engine_kw:
        assert llm.stats()["num_preemptions_swap"] > 0


def test_mla_prefix_cache_hits_and_n_samples_share_the_latent_blocks():
    model, p = tiny_deepseek_v3(), prompts()[2]
    llm = LLM(model, max_model_len=128, block_size=4, enable_prefix_caching=True)
    first = llm.generate([p], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    again = llm.generate([p], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    sp = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    n = llm.generate([p], SamplingParams(n=3, seed=5, **sp), use_tqdm=False)[0]
    solo = [llm.generate([p], SamplingParams(seed=5 + i, **sp), use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
    assert [o.token_ids for o in n.outputs] == solo


def test_latent_cache_bytes_per_token_vs_mha_of_the_same_width():
    """Read from the engine's own cache tensors: MLA keeps kv_lora_rank + rope dims per token and layer."""
    mla = LLM(tiny_deepseek_v3(kv_lora_rank=32, qk_rope_head_dim=8), max_model_len=64)
    mha = LLM(tiny_llama(num_heads=4, num_kv_heads=4), max_model_len=64)   # hidden 64 = 4 heads x 16
    slot = lambda cache: cache[0, 0, 0].numel() * cache.element_size()  # noqa: E731  one token, one layer
    mla_bytes = slot(mla.model_runner.k_cache)                        # the latent; V is a view of it
    mha_bytes = slot(mha.model_runner.k_cache) + slot(mha.model_runner.v_cache)
    assert mla.model_runner.v_cache.data_ptr() == mla.model_runner.k_cache.data_ptr()
    assert mla_bytes == (32 + 8) * 4 and mha_bytes == 2 * 4 * 16 * 4   # 160 vs 512 bytes: 3.2x smaller
    from llmso_lab.engine.cache_sizing import kv_cache_bytes_per_block
    assert kv_cache_bytes_per_block(mla.model.config, 1, torch.float32) == 2 * mla_bytes   # 2 layers


def test_mla_clear_errors():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8,
                           q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                           first_k_dense_replace=1, n_routed_experts=2, num_experts_per_tok=1, rope_scaling=None,
                           n_group=1, topk_group=1)
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        LLM(DeepseekV3ForCausalLM(cfg), max_model_len=64)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_latent_decode_kernel_equals_absorbed_and_naive_mla(num_splits):
    from llmso_lab.attention import mla_paged_decode_attention

    H, dn, dr, dv, r, bs, nb = 4, 16, 8, 12, 32, 4, 20
    cache = rand(nb, bs, 1, r + dr, seed=10)
    tables = torch.randperm(nb, generator=torch.Generator().manual_seed(11))[:15].view(3, 5).int()
    lens = torch.tensor([1, 13, 20], dtype=torch.int32)
    q_nope, q_pe, w_uk, w_uv = rand(3, H, dn, seed=12), rand(3, H, dr, seed=13), rand(H, dn, r, seed=14) / 4, rand(H, dv, r, seed=15) / 4
    q = absorb_query(q_nope, q_pe, w_uk)
    got = mla_paged_decode_attention(q, cache, tables, lens, r, 0.2, num_splits=num_splits)
    torch.testing.assert_close(got, mla_paged_decode_torch(q, cache, tables, lens, r, 0.2), atol=1e-5, rtol=1e-5)
    for b in range(3):   # through W_UV, against the naive (up-projected) MLA of that sequence's tokens
        n = int(lens[b])
        rows = cache[tables[b].long()].reshape(-1, r + dr)[:n]
        naive = mla_attention(q_nope[b:b + 1], q_pe[b:b + 1], rows[:, :r], rows[:, r:], w_uk, w_uv, 0.2, causal=False)
        torch.testing.assert_close(torch.einsum("hr,hvr->hv", got[b], w_uv)[None], naive, atol=1e-4, rtol=1e-4)


def test_engine_triton_backend_serves_mla():
    model = tiny_deepseek_v3(seed=2)
    ps = prompts()
    expected = [hf_greedy(model, p, 6) for p in ps]
    llm = LLM(model, max_model_len=128, attention_backend="triton", enable_prefix_caching=True, block_size=8)
    for _ in range(2):
        outs = llm.generate(ps, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected


def test_bench_kv_store_reads_mla_bytes_from_the_engine_caches():
    from llmso_lab.bench.kv_store import mla_bytes

    assert [r["bytes_per_token_layer"] for r in mla_bytes()] == [(32 + 8) * 4, 2 * 4 * 16 * 4, 2 * 1 * 16 * 4]


def test_lab05_harness_runs_a_decode_function_inside_the_engine():
    """`generate_with_decode`: the reference absorbed decode (and the naive one) reproduce the engine's and HF's tokens;
    a decode that drops the RoPE part of the score does not; a wrong shape is a clear error."""
    from llmso_lab.attention.mla import mla_attention, mla_decode_absorbed
    from llmso_lab.engine.mla import generate_with_decode

    ok = generate_with_decode(mla_decode_absorbed, [4, 19], 5)
    assert ok["equal_to_engine"] and ok["equal_to_hf"] and ok["decode_calls"] == 2 * 2 * 4   # seqs x layers x steps
    assert generate_with_decode(lambda *a: mla_attention(*a), [4, 19], 5)["tokens"] == ok["tokens"]

    def no_rope(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale):
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
        return torch.einsum("thr,hvr->thv", torch.softmax(q_lat @ c_kv.T * scale, -1) @ c_kv, w_uv)

    bad = generate_with_decode(no_rope, [4, 19], 5)
    assert not bad["equal_to_engine"] and bad["tokens"] != ok["tokens"]
    with pytest.raises(ValueError, match=r"expected \[1, H, dv\]"):
        generate_with_decode(lambda q_nope, *a: q_nope[..., :3], [4], 2)
