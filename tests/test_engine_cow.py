"""Copy-on-write in the engine: n > 1 samples against n = 1 seeds, beam search against Hugging Face, the radix
prefix cache against no caching, and the block manager's invariants under random forks, preemption and caching."""
from __future__ import annotations

import random

import pytest
import torch

from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.engine.beam_search import BeamSearchParams
from llmso_lab.engine.sequence import Sequence
from llmso_lab.kv import BlockManager
from llmso_lab.kv.radix import RadixTree
from llmso_lab.models import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model, **kw) -> LLM:
    kw = {"block_size": 8, "num_kv_blocks": 256, "max_model_len": 256, **kw}
    return LLM(model, **kw)


# ---- block manager: fork and copy-on-write -------------------------------------------------------------
def computed_parent_and_empty_child():
    """10 blocks of 4; a parent with 6 computed tokens (2 blocks, the 2nd half full) and a child holding nothing."""
    bm = BlockManager(10, 4)
    parent = Sequence(0, "0", list(range(6)), SamplingParams(), 0.0)
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    return bm, parent, Sequence(1, "0", list(range(6)), SamplingParams(), 0.0)


def test_fork_shares_blocks_and_a_write_copies_the_shared_block():
    bm, parent, child = computed_parent_and_empty_child()
    assert bm.fork(parent, child) == []
    assert child.block_table == parent.block_table and bm.num_free_blocks == 8
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    copies = bm.append_slot(child, 1)          # writes position 6, in the shared 2nd block: copy it first
    assert copies == [(parent.block_table[1], child.block_table[1])] and child.block_table[0] == parent.block_table[0]
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 1]
    assert bm.append_slot(parent, 1) == []     # the parent now holds its 2nd block alone: writes in place
    bm.check_invariants(holders=[parent, child])
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 10


def test_fork_without_sharing_copies_every_block_now():
    bm, parent, child = computed_parent_and_empty_child()
    copies = bm.fork(parent, child, share=False)
    assert [src for src, _ in copies] == parent.block_table and not set(child.block_table) & set(parent.block_table)
    assert bm.num_free_blocks == 6 and bm.append_slot(child, 1) == []


# ---- n > 1 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [False, True])
def test_n_samples_equal_n_requests_seeded_s_plus_i(model, caching):
    p = prompt(37, 0)   # 4 full blocks of 8 + 5 tokens: the 5th block is shared, then copied on write
    sp = dict(temperature=1.0, top_k=50, max_tokens=16, ignore_eos=True)
    llm = engine(model, enable_prefix_caching=caching)
    out = llm.generate(p, SamplingParams(n=4, seed=11, **sp), use_tqdm=False)[0]
    ref = engine(model).generate([p] * 4, [SamplingParams(seed=11 + i, **sp) for i in range(4)], use_tqdm=False)
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert [o.token_ids for o in out.outputs] == [r.outputs[0].token_ids for r in ref]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 4
    assert out.metrics.output_len == 64
    assert llm.stats()["num_cow_copies"] == 3       # the last sample to write keeps the original block
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_n_samples_share_the_prompt_blocks(model):
    p = prompt(120, 1)
    sp = SamplingParams(n=4, seed=3, temperature=1.0, max_tokens=8, ignore_eos=True)
    peaks = {}
    for share in (True, False):
        llm = engine(model, share_kv_blocks=share)
        outs = llm.generate(p, sp, use_tqdm=False)[0].outputs
        peaks[share] = llm.peak_blocks_used
        assert [o.token_ids for o in outs] == [o.token_ids for o in engine(model).generate(p, sp, use_tqdm=False)[0].outputs]
    # 128 tokens = 16 blocks each. Shared: the 15 full prompt blocks once, then 1 block per sample; not shared: 16 each
    assert (peaks[True], peaks[False]) == (15 + 4, 4 * 16)


def test_n_greater_than_one_needs_continuous_batching(model):
    with pytest.raises(ValueError, match="continuous"):
        engine(model, batching="static").generate(prompt(5, 0), SamplingParams(n=2), use_tqdm=False)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


# ---- beam search ----------------------------------------------------------------------------------------
def hf_beams(model, p, width, max_tokens, eos=None):
    kw = {} if eos is None else {"eos_token_id": eos}
    out = model.generate(torch.tensor([p]), num_beams=width, do_sample=False, length_penalty=1.0, early_stopping=True,
                         max_new_tokens=max_tokens, num_return_sequences=width, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences.tolist(), out.sequences_scores.tolist()


def test_beam_width_one_is_greedy(model):
    p = prompt(21, 0)
    res = engine(model).beam_search([p], BeamSearchParams(beam_width=1, max_tokens=10), use_tqdm=False)[0]
    greedy = engine(model).generate(p, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert res.sequences[0].tokens == p + greedy.outputs[0].token_ids


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_hf_beams(model, width):
    for seed in (0, 1):
        p = prompt(21 + seed * 6, seed)
        res = engine(model).beam_search([p], BeamSearchParams(beam_width=width, max_tokens=10), use_tqdm=False)[0]
        seqs, scores = hf_beams(model, p, width, 10)
        assert [s.tokens for s in res.sequences] == seqs
        assert [s.score for s in res.sequences] == pytest.approx(scores, abs=1e-5)


def test_beam_search_with_eos_finishing_beams_early_matches_hf(model):
    p = prompt(16, 4)
    greedy = engine(model).generate(p, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    eos = greedy[0]   # the most likely first token ends a beam at once
    model.generation_config.eos_token_id = eos
    try:
        res = engine(model).beam_search(p, BeamSearchParams(beam_width=3, max_tokens=12), use_tqdm=False)[0]
        seqs, scores = hf_beams(model, p, 3, 12, eos)
    finally:
        model.generation_config.eos_token_id = 2
    assert any(s.finish_reason == "stop" for s in res.sequences)
    for mine, theirs in zip(res.sequences, seqs):   # HF fills a finished beam's tail with pad_token_id or else EOS
        assert mine.tokens == theirs[:len(mine.tokens)] and set(theirs[len(mine.tokens):]) <= {eos}
    assert [s.score for s in res.sequences] == pytest.approx(scores, abs=1e-5)


def test_beam_search_survives_preemption_and_frees_everything(model):
    p, others = prompt(30, 5), [prompt(50, 7), prompt(48, 8)]
    width, T, sp = 4, 12, SamplingParams(max_tokens=14, ignore_eos=True)
    ok = engine(model).beam_search(p, BeamSearchParams(beam_width=width, max_tokens=T), use_tqdm=False)[0]
    ok_others = [o.outputs[0].token_ids for o in engine(model).generate(others, sp, use_tqdm=False)]
    # the beams alone fit (4 x 6 blocks); with two longer requests that arrived first, fcfs preempts beams
    llm = engine(model, num_kv_blocks=24, max_model_len=64)
    for o in others:
        llm.add_request(o, sp)
    res = llm.beam_search(p, BeamSearchParams(beam_width=width, max_tokens=T), use_tqdm=False)[0]
    assert [s.tokens for s in res.sequences] == [s.tokens for s in ok.sequences]
    assert llm.stats()["num_preemptions_total"] > 0
    rest = []
    while llm.has_unfinished_requests():
        rest += llm.step()[0]
    assert [o.outputs[0].token_ids for o in sorted(rest, key=lambda o: int(o.request_id))] == ok_others
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    llm.scheduler.check_invariants()


def test_beam_search_rejects_what_cannot_fit(model):
    with pytest.raises(ValueError, match="KV blocks"):
        engine(model, num_kv_blocks=8, max_model_len=64).beam_search(prompt(40, 0), BeamSearchParams(4, 20), use_tqdm=False)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)


def test_beams_share_blocks_and_pruned_beams_free_theirs(model):
    p = prompt(64, 6)
    peaks = {}
    for share in (True, False):
        llm = engine(model, share_kv_blocks=share)
        llm.beam_search(p, BeamSearchParams(beam_width=4, max_tokens=16), use_tqdm=False)
        peaks[share] = llm.peak_blocks_used
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert peaks[False] >= 4 * 10 and peaks[True] <= 8 + 4 * 3   # 80 tokens = 10 blocks; shared: prompt once


# ---- radix prefix cache ---------------------------------------------------------------------------------
def test_radix_tree_splits_and_matches_at_token_granularity():
    t = RadixTree()
    assert t.insert([1, 2, 3, 4, 5]) == 0
    assert t.insert([1, 2, 3, 9]) == 3 and t.num_nodes() == 3          # [1,2,3] -> {[4,5], [9]}
    assert t.match_prefix([1, 2, 3, 9, 9]) == 4 and t.match_prefix([1, 2, 7]) == 2 and t.match_prefix([7]) == 0
    assert t.insert([1, 2, 3, 4, 5, 6]) == 5 and t.num_nodes() == 4


def test_radix_tree_eviction_cuts_the_path_after_the_block():
    t = RadixTree(block_size=4)
    t.insert(list(range(10)), [7, 8, 9])                     # blocks hold positions 0-3, 4-7, 8-9
    # diverges at 6, inside block 1: the branch has its own block 6 there (positions 4-5 copied from block 8)
    t.insert(list(range(6)) + [50, 51, 52], [7, 6, 5])
    assert t.blocks_of(t.match(list(range(6)) + [50, 51, 52])) == [7, 6, 5]   # the deeper node's block wins
    assert t.blocks_of(t.match(list(range(6)) + [50])) == [7, 6]
    assert t.blocks_of(t.match(list(range(7)))) == [7, 8]
    assert t.evict_block(8) == {8, 9, 6, 5}                  # positions >= 4 of that path go, the branch with them
    assert t.match_prefix(list(range(10))) == 4 and t.num_nodes() == 1


def branching_prompts(seed: int, n: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(3, 256) for _ in range(40)]
    return [base[:rng.randrange(3, 40)] + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 10))] for _ in range(n)]


@pytest.mark.parametrize("num_kv_blocks", [400, 36])
def test_radix_greedy_outputs_equal_no_caching_and_hit_more_than_hash(model, num_kv_blocks):
    prompts, sp = branching_prompts(0), SamplingParams(max_tokens=6, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in engine(model, block_size=4, num_kv_blocks=400).generate(prompts, sp, use_tqdm=False)]
    hits = {}
    for algo in ("hash", "radix"):
        llm = engine(model, block_size=4, num_kv_blocks=num_kv_blocks, max_num_seqs=4, enable_prefix_caching=True,
                     prefix_caching_algo=algo, max_model_len=64)
        got = []
        for i in range(0, len(prompts), 4):   # waves, so later prompts find earlier ones in the cache
            got += [o.outputs[0].token_ids for o in llm.generate(prompts[i:i + 4], sp, use_tqdm=False)]
            llm.scheduler.check_invariants()
        assert got == ref, algo
        hits[algo] = llm.stats()["prefix_cache_hit_tokens"]
        if num_kv_blocks < 100:
            assert llm.stats()["prefix_cache_evictions"] > 0
    assert hits["radix"] > hits["hash"]


@pytest.mark.parametrize("algo", ["hash", "radix"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_workloads_with_forks_preemption_and_caching_keep_invariants(model, algo, mode):
    rng = random.Random(hash((algo, mode)) % 1000)
    prompts = branching_prompts(1, 16)
    llm = engine(model, block_size=4, num_kv_blocks=24, max_model_len=64, max_num_seqs=6, enable_prefix_caching=True,
                 prefix_caching_algo=algo, preemption_mode=mode, max_num_batched_tokens=64)
    ref = engine(model, block_size=4, num_kv_blocks=400, max_model_len=64)
    expected = {}
    for i, p in enumerate(prompts):
        n = rng.choice([1, 1, 2, 3])
        sp = SamplingParams(n=n, seed=i * 10, temperature=1.0, max_tokens=rng.randrange(2, 14), ignore_eos=True)
        rid = llm.add_request(p, sp)
        expected[rid] = [o.token_ids for o in ref.generate(p, sp, use_tqdm=False)[0].outputs]
    done = {}
    while llm.has_unfinished_requests():
        finished, _ = llm.step()
        llm.scheduler.check_invariants()
        done.update({o.request_id: [c.token_ids for c in o.outputs] for o in finished})
    assert done == expected
    assert llm.stats()["num_preemptions_total"] > 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks   # no leak


def test_bench_cow_sweep_matches_the_sharing_formula():
    from llmso_lab.bench.cow import sweep

    for row in sweep((16, 64), (32, 96), n=4):
        assert row["saving"] == pytest.approx(row["formula"]), row   # (n-1)/n x prompt/(prompt+output), block-aligned
