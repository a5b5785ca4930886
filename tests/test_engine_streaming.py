"""StreamingLLM in the engine (`LLM(kv_eviction=...)`, `llmso_lab.kv.streaming`): block-granular sinks + window.

The reference is independent of the engine: a Hugging Face forward over the WHOLE sequence (original positions)
with an attention mask that hides what the engine's cache no longer holds when each token is computed. A token
computed in a step after which its sequence spans L blocks sees the sink blocks and blocks >= L - window - 1
(decode: L = its block + 1). The prefill chunks are read from the engine's step traces, not from the rule.
"""
from __future__ import annotations

import pytest
import torch

from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.engine.beam_search import BeamSearchParams
from llmso_lab.engine.hf_reference import hf_greedy
from llmso_lab.kv.streaming import StreamingEviction, max_chunk_tokens, num_blocks_to_evict, streaming_block_keep
from llmso_lab.models import tiny_llama

torch.set_num_threads(1)
MODEL = tiny_llama(num_layers=2, max_position_embeddings=512)
BS, SINK, WINDOW = 4, 1, 3           # a sequence holds at most 1 + 3 + 1 = 5 blocks = 20 tokens
EVICT = {"method": "streaming", "num_sink_blocks": SINK, "window_blocks": WINDOW}


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def engine(**kw):
    kw.setdefault("block_size", BS)
    kw.setdefault("max_model_len", 512)
    kw.setdefault("kv_eviction", EVICT)
    return LLM(MODEL, **kw)


@torch.inference_mode()
def masked_reference(prompt: list[int], n_new: int, chunks: list[int], sink: int = SINK, window: int = WINDOW) -> list[int]:
    """Greedy tokens of a full forward whose mask hides, from each token, the blocks evicted before it was computed.
    `chunks`: the prompt's prefill chunk sizes (one forward each)."""
    blocks_after = {}   # position -> blocks the sequence spans after the step that computed it
    c = 0
    for n in chunks:
        blocks_after.update({p: -(-(c + n) // BS) for p in range(c, c + n)})
        c += n
    assert c == len(prompt)
    seq = list(prompt)
    for _ in range(n_new):
        T = len(seq)
        allow = torch.ones(T, T).tril().bool()
        for p in range(T):
            first_recent = blocks_after.get(p, p // BS + 1) - window - 1
            for j in range(p + 1):
                allow[p, j] = j // BS < sink or j // BS >= first_recent
        mask = torch.zeros(T, T).masked_fill(~allow, float("-inf"))[None, None]
        seq.append(int(MODEL(input_ids=torch.tensor([seq]), attention_mask=mask).logits[0, -1].argmax()))
    return seq[len(prompt):]


def run(llm: LLM, prompts: list[list[int]], n_new: int, max_blocks: int | None = None):
    """Step `llm` to completion, checking the block manager every step. Returns (outputs, prefill chunks per request,
    the most blocks one sequence held, the most blocks used)."""
    ids = [llm.add_request({"prompt_token_ids": p}, greedy(n_new)) for p in prompts]
    outs, chunks, most_held, most_used = {}, {i: [] for i in ids}, 0, 0
    while llm.has_unfinished_requests():
        done, trace = llm.step()
        for rid, n in trace.prefill.items():
            chunks[rid].append(n)
        llm.scheduler.check_invariants()
        most_held = max([most_held] + [len(s.block_table) for s in llm.scheduler.running])
        most_used = max(most_used, llm.block_manager.num_used_blocks)
        for o in done:
            outs[o.request_id] = o.outputs[0].token_ids
    return [outs[i] for i in ids], [chunks[i] for i in ids], most_held, most_used


def test_block_rule():
    """The pure rule: the keep-set by brute force, and a decode-only sequence driven by the eviction arithmetic keeps
    exactly that set (sinks + last window + the block being filled)."""
    for S, W in [(1, 3), (0, 2), (2, 1), (4, 4)]:
        ev = StreamingEviction(S, W)
        assert ev.max_blocks_per_seq == S + W + 1
        for nb in range(0, 20):
            want = [b for b in range(nb) if b < S or b >= nb - W - 1]
            assert streaming_block_keep(nb, S, W) == want
        table, evicted = [], 0   # logical block ids held, as the scheduler + block manager would
        for c in range(0, 120):   # decode the token at position c
            assert max_chunk_tokens(c, BS, ev) >= 1
            k = num_blocks_to_evict(c, 1, evicted, BS, ev)
            del table[S:S + k]
            evicted += k
            table += list(range(len(table) + evicted, -(-(c + 1) // BS)))
            assert table == streaming_block_keep(-(-(c + 1) // BS), S, W), (S, W, c)
    # a chunk may span at most window + 1 blocks past the sinks
    ev = StreamingEviction(1, 3)
    assert max_chunk_tokens(0, 4, ev) == 20 and max_chunk_tokens(20, 4, ev) == 16 and max_chunk_tokens(22, 4, ev) == 14
    with pytest.raises(ValueError, match="window_blocks"):
        streaming_block_keep(5, 1, 0)


def test_large_budget_equals_plain_engine():
    """Nothing is evicted when the window covers the sequence: tokens equal the plain engine and HF generate."""
    prompts = [list(range(3, 13)), list(range(40, 47))]
    plain = LLM(MODEL, block_size=BS, max_model_len=512).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(30), use_tqdm=False)
    big = engine(kv_eviction={"method": "streaming", "num_sink_blocks": 1, "window_blocks": 20})
    outs, _, _, _ = run(big, prompts, 30)
    assert outs == [o.outputs[0].token_ids for o in plain]
    assert outs[0] == hf_greedy(MODEL, prompts[0], 30)
    assert big.stats()["kv_evicted_blocks"] == 0


def test_small_budget_matches_masked_reference():
    """50 tokens through a 5-block (20-token) cache: eviction after eviction, greedy tokens equal the masked full
    forward; the plain engine (no eviction) diverges, so the test can tell."""
    prompt, n = list(range(3, 13)), 50
    llm = engine(num_kv_blocks=8)
    (out,), (chunks,), held, used = run(llm, [prompt], n)
    assert chunks == [10] and held == used == SINK + WINDOW + 1
    assert llm.stats()["kv_evicted_blocks"] == -(-(len(prompt) + n - 1) // BS) - (SINK + WINDOW + 1)   # 10
    assert out == masked_reference(prompt, n, chunks)
    assert out != hf_greedy(MODEL, prompt, n)


def test_long_prompt_is_prefilled_in_chunks_evicting_between_them():
    """A 30-token prompt into a 20-token budget: chunks of at most window + 1 blocks past the sinks (the token budget
    splits them further), evicting between them; the tokens equal the chunk-aware masked reference."""
    prompt = [(7 * i + 3) % 250 + 3 for i in range(30)]
    for budget, want_chunks in [(2048, [20, 10]), (12, [12, 12, 6]), (18, [18, 12])]:
        llm = engine(num_kv_blocks=6, max_num_batched_tokens=budget)
        (out,), (chunks,), held, _ = run(llm, [prompt], 12)
        assert chunks == want_chunks and held <= SINK + WINDOW + 1
        assert out == masked_reference(prompt, 12, chunks), budget


def test_several_sequences_generate_past_the_cache_capacity():
    """Three sequences, each generating more tokens than the whole cache holds (15 blocks x 4 = 60 < 70): they all
    complete, each holds at most 5 blocks, the block manager's invariants hold every step, all blocks come back, and
    each sequence's tokens equal its masked reference (batching does not change what a sequence sees)."""
    prompts = [list(range(3, 12)), list(range(100, 114)), [5, 9, 200]]
    n = 70
    llm = engine(num_kv_blocks=15)
    outs, chunks, held, used = run(llm, prompts, n)
    assert all(len(o) == n for o in outs) and n > 15 * BS
    assert held <= SINK + WINDOW + 1 and used <= 15 and llm.block_manager.num_used_blocks == 0
    assert llm.stats()["num_preemptions_total"] == 0
    for p, o, c in zip(prompts, outs, chunks):
        assert o == masked_reference(p, n, c)


def test_recompute_preemption_completes():
    """Two sequences in a cache of 7 blocks (one needs up to 5): one is preempted by recompute, recomputed in
    budget-sized chunks, and both complete with the invariants intact (its later tokens may differ: documented)."""
    llm = engine(num_kv_blocks=7)
    outs, _, held, used = run(llm, [[3, 4, 5], [30, 31, 32]], 30)
    assert [len(o) for o in outs] == [30, 30] and held <= 5 and used <= 7
    assert llm.stats()["num_preemptions_recompute"] > 0 and llm.block_manager.num_used_blocks == 0


def test_stops_at_max_model_len():
    """Original positions: a sequence still ends at max_model_len (what eviction bounds is memory, not length)."""
    llm = engine(max_model_len=40, num_kv_blocks=5)
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, greedy(100), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 37 and out.finish_reason == "length"


@pytest.mark.parametrize("kw, message", [
    (dict(kv_eviction={"method": "h2o"}), "not supported in the engine"),
    (dict(kv_eviction={"num_sink_blocks": 1, "window": 3}), "unknown kv_eviction keys"),
    (dict(kv_eviction={"window_blocks": 0}), "window_blocks must be"),
    (dict(kv_eviction={"num_sink_blocks": -1}), "num_sink_blocks must be"),
    (dict(kv_eviction="streaming"), "must be a dict"),
    (dict(enable_prefix_caching=True), "enable_prefix_caching"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
    (dict(preemption_mode="swap"), "swap"),
    (dict(batching="static"), "continuous"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
    (dict(enable_chunked_prefill=False), "enable_chunked_prefill"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype='int8'"),
    (dict(num_kv_blocks=4), "cannot hold one sequence under kv_eviction"),
])
def test_refused_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        engine(**kw)


def test_refused_requests_and_models():
    llm = engine()
    with pytest.raises(ValueError, match="n=2 cannot be combined with kv_eviction"):
        llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(n=2, max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="beam_search cannot be combined with kv_eviction"):
        llm.beam_search({"prompt_token_ids": [3, 4]}, BeamSearchParams(beam_width=2, max_tokens=4), use_tqdm=False)
    from transformers import MistralConfig, MistralForCausalLM
    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                               sliding_window=7))
    with pytest.raises(ValueError, match="sliding-window"):
        LLM(mistral, block_size=BS, kv_eviction=EVICT)
    from llmso_lab.models.tiny import tiny_deepseek_v3
    with pytest.raises(ValueError, match="MLA"):
        LLM(tiny_deepseek_v3(num_layers=1), block_size=BS, kv_eviction=EVICT)
    # without eviction a sequence must fit the cache: the relaxation applies only under kv_eviction
    with pytest.raises(ValueError, match="cannot hold"):
        LLM(MODEL, block_size=BS, max_model_len=512, num_kv_blocks=8)


def test_triton_backend_reads_the_same_evicted_cache():
    """The Triton kernels (interpreter on CPU) index the cache through the same shortened block tables: a chunk after
    an eviction (flash attention over the gathered cache) and paged decodes give the masked reference's tokens."""
    prompt = [(5 * i + 1) % 250 + 3 for i in range(22)]
    llm = engine(num_kv_blocks=6, max_num_batched_tokens=12, attention_backend="triton")
    (out,), (chunks,), held, _ = run(llm, [prompt], 6)
    assert chunks == [12, 10] and held <= SINK + WINDOW + 1 and llm.stats()["kv_evicted_blocks"] >= 2
    assert out == masked_reference(prompt, 6, chunks)


def test_a_policy_class_plugs_into_the_growth_seam():
    """`kv_eviction={"policy": cls}` swaps the class that applies the rule: the library policy through that seam gives
    the built-in engine's tokens and decisions; a policy that never evicts holds more blocks than the rule allows and
    its tokens differ (so Lab 10's harness can tell); a class without cap() is refused."""
    from llmso_lab.kv.streaming import StreamingEvictionPolicy, run_policy_in_engine

    prompt = [(7 * i + 3) % 250 + 3 for i in range(30)]
    built_in = engine(num_kv_blocks=6, max_num_batched_tokens=12)
    (want,), _, _, _ = run(built_in, [prompt], 12)
    got = run_policy_in_engine(StreamingEvictionPolicy, [prompt], 12, 1, 3, num_kv_blocks=6, max_num_batched_tokens=12)
    assert got["tokens"] == [want] and got["most_blocks_held"] == SINK + WINDOW + 1 and got["blocks_free_after"]
    assert got["kv_evicted_blocks"] == built_in.stats()["kv_evicted_blocks"] > 0
    # every cap call: what was asked, what was granted, and the blocks held never exceed the rule's after the step
    assert all(granted <= asked and held <= SINK + WINDOW + 1 for _, _, asked, granted, _, held in got["caps"])

    class Hoarder(StreamingEvictionPolicy):   # caps the chunks but never drops a block
        def cap(self, seq, n):
            return min(n, max_chunk_tokens(seq.num_computed_tokens, self.block_size, self.ev))

    hoard = run_policy_in_engine(Hoarder, [prompt], 12, 1, 3, num_kv_blocks=16, max_num_batched_tokens=12)
    assert hoard["kv_evicted_blocks"] == 0 and hoard["most_blocks_held"] > SINK + WINDOW + 1
    assert hoard["tokens"] != got["tokens"]
    with pytest.raises(ValueError, match="policy must be a class with a cap"):
        engine(kv_eviction={**EVICT, "policy": object})
