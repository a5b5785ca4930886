"""Block manager: allocation and ref counts, prefix caching by hash chain, LRU reuse of freed cached blocks, swap
(`engine.swap.SwapSpace`, the block-level part of preemption by swap)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from llmso_lab.engine.sampling_params import SamplingParams
from llmso_lab.engine.sequence import Sequence
from llmso_lab.engine.swap import SwapSpace
from llmso_lab.kv import BlockManager

BS = 4


def seq(tokens, seq_id=0):
    return Sequence(seq_id, str(seq_id), list(tokens), SamplingParams(), 0.0)


def compute(bm, s, n=None):
    """Admit `s` and pretend its whole token list was computed (as the engine does after a forward)."""
    n = s.num_tokens - s.num_computed_tokens if n is None else n
    if not s.block_table:
        bm.allocate(s, s.num_tokens - len(bm.get_computed_blocks(s)) * BS if n is None else n, bm.get_computed_blocks(s))
        n = s.num_tokens - s.num_computed_tokens
    else:
        bm.append_slot(s, n)
    s.num_computed_tokens += n
    bm.cache_full_blocks(s)


def test_allocate_append_free_roundtrip():
    bm = BlockManager(8, BS)
    s = seq(range(10))
    assert bm.can_allocate(s, 10)
    bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    s.num_computed_tokens = 10
    s.token_ids += [1, 2]
    assert bm.may_append(s, 2)
    bm.append_slot(s, 2)          # 12 tokens still fit in 3 blocks
    assert len(s.block_table) == 3
    s.num_computed_tokens = 12
    bm.append_slot(s, 1)          # the 13th needs a 4th block
    assert len(s.block_table) == 4 and len(set(s.block_table)) == 4
    bm.check_invariants([s])
    bm.free(s)
    assert bm.num_free_blocks == 8 and not s.block_table
    bm.check_invariants([])


def test_cannot_allocate_beyond_capacity_and_double_free_asserts():
    bm = BlockManager(2, BS)
    s = seq(range(9))
    assert not bm.can_allocate(s, 9)   # needs 3 blocks
    assert bm.can_allocate(s, 8)
    bm.allocate(s, 8)
    assert not bm.may_append(s, 9)
    blocks = list(s.block_table)
    bm.free(s)
    s.block_table = blocks
    with pytest.raises(AssertionError, match="double free"):
        bm.free(s)


def test_prefix_hit_shares_blocks_and_counts_hits():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], 0)
    compute(bm, a)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 99, 98], 1)       # same first two blocks
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_table[:2]
    bm.allocate(b, b.num_tokens - 8, hits)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert bm.prefix_cache_hit_rate == pytest.approx(8 / (13 + 10))
    bm.check_invariants([a, b])
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    bm.check_invariants([])


def test_only_full_and_computed_blocks_are_hashed():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    s = seq(range(12))
    bm.allocate(s, 12)
    s.num_computed_tokens = 6            # a chunk: block 0 is full and computed, block 1 is not
    bm.cache_full_blocks(s)
    assert len(s.prefix_ids) == 1 and len(bm.hash_to_block_id) == 1
    assert bm.get_computed_blocks(seq(range(13), 1)) == s.block_table[:1]
    s.num_computed_tokens = 12
    bm.cache_full_blocks(s)
    assert bm.get_computed_blocks(seq(range(13), 2)) == s.block_table


def test_hash_chain_depends_on_the_whole_prefix():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    compute(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 0], 0))
    other_parent = seq([9, 9, 9, 9, 5, 6, 7, 8, 0], 1)   # same second block, different first block
    assert bm.get_computed_blocks(other_parent) == []


def test_fully_cached_prompt_recomputes_its_last_token():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    compute(bm, seq(range(8), 0))
    again = seq(range(8), 1)
    assert len(bm.get_computed_blocks(again)) == 1       # 8 tokens cached, but only 4 may be reused
    assert len(bm.get_computed_blocks(seq(range(9), 2))) == 2


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    old, new = seq([1] * 8 + [0], 0), seq([2] * 8 + [0], 1)
    compute(bm, old)
    compute(bm, new)
    bm.free(old)    # freed first: least recently used
    bm.free(new)
    assert bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 4
    # the freed blocks still serve hits (and leave the free list while used)
    probe = seq([1] * 8 + [5], 2)
    assert len(bm.get_computed_blocks(probe)) == 2
    # need 3 fresh blocks: the 2 uncached ones go first, then the LRU cached block (old's last block)
    filler = seq(range(100, 112), 3)
    bm.allocate(filler, 12)
    assert bm.num_evictions == 1
    assert len(bm.get_computed_blocks(seq([1] * 8 + [5], 4))) == 1   # old lost its 2nd block (freed before its 1st)
    assert len(bm.get_computed_blocks(seq([2] * 8 + [5], 5))) == 2   # new is intact
    bm.check_invariants([filler])


def test_hit_on_free_cached_block_revives_it():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = seq([3] * 8 + [1], 0)
    compute(bm, a)
    bm.free(a)
    b = seq([3] * 8 + [2, 2, 2, 2, 2, 2, 2, 2], 1)
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    assert bm.can_allocate(b, 8, hits)        # 2 revived + 2 new = 4 blocks
    assert not bm.can_allocate(b, 9, hits)    # 2 revived + 3 new > 4
    bm.allocate(b, 8, hits)
    assert bm.num_free_blocks == 0 and b.block_table[:2] == hits
    bm.check_invariants([b])


def test_swap_out_and_in():
    bm = BlockManager(6, BS)
    space = SwapSpace(bm, 3)
    s = seq(range(10))
    bm.allocate(s, 10)
    s.num_computed_tokens = 10
    device_blocks = list(s.block_table)
    assert space.can_swap_out(s)
    out = space.swap_out(s)
    assert [d for d, _ in out] == device_blocks and bm.num_free_blocks == 6
    assert sorted(space.tables[s].values()) == [0, 1, 2] and s.block_table == [None] * 3 and not space.free_ids
    bm.check_invariants([s])
    space.check_invariants([s])
    assert space.can_swap_in(s, 1)               # 3 blocks back, the 11th token fits in the 3rd
    back = space.swap_in(s)
    assert [c for c, _ in back] == [c for _, c in out] and len(set(s.block_table)) == 3
    assert len(space.free_ids) == 3 and bm.num_free_blocks == 3
    bm.check_invariants([s])
    big = seq(range(20), 1)
    bm.free(s)
    bm.allocate(big, 20)
    assert space.can_swap_out(big)               # nothing computed yet: nothing to copy
    big.num_computed_tokens = 20
    assert not space.can_swap_out(big)           # 5 blocks > 3 swap blocks


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 5), st.integers(1, 9)),
                    min_size=1, max_size=60),
       num_blocks=st.integers(3, 12), caching=st.booleans())
def test_random_operations_keep_invariants(ops, num_blocks, caching):
    """Random admit / grow / free sequences, with prefixes drawn from a small alphabet so that hits occur:
    ref counts always equal the number of holders, nothing leaks, nothing is freed twice."""
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    live: dict[int, Sequence] = {}
    for i, (op, key, n) in enumerate(ops):
        if op == "admit" and key not in live:
            s = seq([key % 2] * (BS * (key % 3)) + list(range(n)), i)
            hits = bm.get_computed_blocks(s)
            todo = s.num_tokens - len(hits) * BS
            if bm.can_allocate(s, todo, hits):
                bm.allocate(s, todo, hits)
                s.num_computed_tokens += todo
                bm.cache_full_blocks(s)
                live[key] = s
        elif op == "grow" and key in live:
            s = live[key]
            s.token_ids += [7] * n
            if bm.may_append(s, n):
                bm.append_slot(s, n)
                s.num_computed_tokens += n
                bm.cache_full_blocks(s)
            else:
                del s.token_ids[-n:]
        elif op == "free" and key in live:
            bm.free(live.pop(key))
        bm.check_invariants(live.values())
        for s in live.values():
            assert len(s.block_table) * BS >= s.num_computed_tokens
    for s in live.values():
        bm.free(s)
    assert bm.num_free_blocks == num_blocks
    bm.check_invariants([])


@pytest.mark.parametrize("fake_hash", [lambda parent, tokens: 0, lambda parent, tokens: hash((parent, tokens)) % 3],
                         ids=["constant", "three-values"])
def test_a_hash_collision_never_reuses_a_wrong_block(monkeypatch, fake_hash):
    """The hash only finds a candidate; a hit needs the same tokens after the same cached prefix (vLLM's
    CVE-2025-25183 was a collision reusing another prefix's KV). Forced collisions: a block repeated at
    several positions must not be served by the block computed at another position."""
    import llmso_lab.kv.block_manager as block_manager

    monkeypatch.setattr(block_manager, "hash_block", fake_hash)
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    a = seq([1, 2, 3, 4] * 3 + [5, 6, 7, 8] + [9], 0)
    compute(bm, a)
    for tokens in ([1, 2, 3, 4] * 3 + [0], [1, 2, 3, 4, 5, 6, 7, 8, 0], [5, 6, 7, 8, 1, 2, 3, 4, 0],
                   [1, 2, 3, 4] * 4 + [0]):
        b = seq(tokens, 1)
        hits = bm.get_computed_blocks(b)
        for i, block_id in enumerate(hits):   # a hit is a block of `a` at the same position with the same prefix
            assert block_id == a.block_table[i] and tokens[:(i + 1) * BS] == a.token_ids[:(i + 1) * BS], (tokens, hits)
        compute(bm, b)
        bm.check_invariants([a, b])
        bm.free(b)


def test_swap_keeps_shared_blocks_and_finds_cached_ones_again():
    """Swap composes with prefix caching: a swap-out copies and frees only the blocks the sequence holds alone
    (a shared prefix stays on the device, still referenced); a swap-in shares blocks that are still cached
    instead of copying them into fresh ones, and re-caches the ones it had to copy."""
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    space = SwapSpace(bm, 8)
    a = seq([1] * 8 + [2], 0)
    compute(bm, a)                                   # caches [1]*4, [1]*4
    b = seq([1] * 8 + [3, 4, 5, 6, 7], 1)
    bm.allocate(b, 5, bm.get_computed_blocks(b))     # shares a's 2 blocks
    b.num_computed_tokens = 13
    bm.cache_full_blocks(b)                          # caches [3..6]; holds [7] alone
    table, used = list(b.block_table), bm.num_used_blocks
    copies = space.swap_out(b)
    assert [d for d, _ in copies] == table[2:]       # only b's own blocks are copied ...
    assert bm.num_used_blocks == used - 2            # ... and freed
    assert b.block_table[:2] == table[:2] and bm.blocks[table[0]].ref_count == 2
    bm.check_invariants([a, b])
    space.check_invariants([b])
    back = space.swap_in(b)
    assert len(back) == 1 and b.block_table[:3] == table[:3]   # [3..6] found in the cache: shared, not copied
    assert bm.num_used_blocks == used
    bm.check_invariants([a, b])
    # evicted while swapped out: copied back, and cached again under its old key
    space.swap_out(b)
    filler = seq(range(100, 120), 2)
    bm.allocate(filler, 20)                          # takes every free block, evicting b's cached [3..6]
    bm.free(filler)
    assert space.can_swap_in(b) and len(space.swap_in(b)) == 2
    b.num_computed_tokens = b.num_tokens
    again = seq([1] * 8 + [3, 4, 5, 6, 0], 3)
    assert bm.get_computed_blocks(again) == b.block_table[:3]
    bm.check_invariants([a, b])
