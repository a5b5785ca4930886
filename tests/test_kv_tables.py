"""Lab 04's references: `BlockAllocator` (block tables by sequence id over the engine's BlockManager), the prefix-cache
hash chain (`block_hash_chain`, `cached_prefix_tokens`) and the bounded-load routing decision (`bounded_load_pick`)."""
from __future__ import annotations

import random

import pytest

from llmso_lab.engine.sampling_params import SamplingParams
from llmso_lab.engine.sequence import Sequence
from llmso_lab.kv import BlockManager
from llmso_lab.kv.block_manager import ROOT, block_hash_chain, cached_prefix_tokens, hash_block
from llmso_lab.kv.tables import BlockAllocator
from llmso_lab.routing import PrefixAwareBounded, bounded_load_pick


# ---- BlockAllocator ----------------------------------------------------------------------------------
def test_fork_shares_and_copy_on_write_copies_only_the_shared_partial_block():
    a = BlockAllocator(10, 4)
    a.allocate("p", 7)                                  # blocks: 4 + 3 tokens
    a.fork("p", "c")
    assert a.ref_counts("p") == a.ref_counts("c") == [2, 2] and a.num_free_blocks() == 8
    assert a.append("c") == 1                           # the shared last block is copied for c
    assert a.ref_counts("c") == a.ref_counts("p") == [2, 1] and a.num_free_blocks() == 7
    assert a.append("p") == 0                           # p holds its last block alone now
    assert a.append("p", 4) == 0 and a.ref_counts("p") == [2, 1, 1]   # 12 tokens: 3 blocks
    a.free("p")
    assert a.ref_counts("c") == [1, 1] and a.num_free_blocks() == 8
    a.free("c")
    assert a.num_free_blocks() == 10


def test_a_full_shared_block_is_never_copied():
    a = BlockAllocator(8, 4)
    a.allocate(0, 8)
    a.fork(0, 1)
    assert a.append(1) == 0 and a.append(0) == 0
    assert a.ref_counts(0) == a.ref_counts(1) == [2, 2, 1]


def test_out_of_blocks_raises_memory_error_and_changes_nothing():
    a = BlockAllocator(3, 4)
    a.allocate("p", 10)
    with pytest.raises(MemoryError):
        a.allocate("q", 1)
    a.fork("p", "c")
    with pytest.raises(MemoryError):                    # the copy-on-write copy needs a free block
        a.append("c")
    assert a.num_free_blocks() == 0 and a.ref_counts("c") == [2, 2, 2]
    a.free("p")
    assert a.append("c") == 0 and a.ref_counts("c") == [1, 1, 1]
    with pytest.raises(MemoryError):
        a.append("c", 3)                                # 13 tokens need a 4th block
    with pytest.raises(KeyError):
        a.append("nobody")
    with pytest.raises(ValueError):
        a.fork("c", "c")


def test_random_forks_appends_frees_keep_the_block_managers_invariants():
    rng = random.Random(0)
    a = BlockAllocator(40, 4)
    live, next_id = [], 0
    for _ in range(600):
        op = rng.choice(["allocate", "fork", "append", "append", "free"])
        try:
            if op == "allocate" or not live:
                a.allocate(next_id, rng.randint(1, 9))
                live.append(next_id)
                next_id += 1
            elif op == "fork":
                a.fork(rng.choice(live), next_id)
                live.append(next_id)
                next_id += 1
            elif op == "append":
                a.append(rng.choice(live), rng.randint(1, 6))
            else:
                s = rng.choice(live)
                a.free(s)
                live.remove(s)
        except MemoryError:
            pass
        a.manager.check_invariants(list(a.seqs.values()))
        assert sum(a.manager.blocks[b].ref_count == 0 for b in range(40)) == a.num_free_blocks()


# ---- the prefix-cache hash chain ---------------------------------------------------------------------
def test_block_hash_chain_keys_full_blocks_and_names_the_whole_prefix():
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    assert block_hash_chain(x + y + [0], 4) == [hash_block(ROOT, tuple(x)), hash_block(hash_block(ROOT, tuple(x)), tuple(y))]
    assert block_hash_chain([1, 2, 3], 4) == []
    a, b = block_hash_chain(x + y, 4), block_hash_chain(z + y, 4)
    assert a[1] != b[1]                                 # the same block after another prefix is another block
    assert block_hash_chain(x + y + z, 4)[:2] == a      # a prefix's keys are the start of the longer list's


def test_cached_prefix_tokens_walks_until_the_first_miss_and_leaves_the_last_token():
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    cache = set(block_hash_chain(x + y + z, 4))
    assert cached_prefix_tokens(x + y + [0], cache, 4) == 8
    assert cached_prefix_tokens(y + x + [0], cache, 4) == 0      # y is cached only after x
    assert cached_prefix_tokens(x + y + z, cache, 4) == 8        # fully cached: the last block is computed again
    assert cached_prefix_tokens(x + z + [0], list(cache), 4) == 4
    assert cached_prefix_tokens([7], cache, 4) == 0


def test_cached_prefix_tokens_matches_the_engines_hash_cache():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    first = Sequence(0, "0", list(range(1, 15)), SamplingParams(), 0.0)
    bm.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    bm.cache_full_blocks(first)
    keys = set(block_hash_chain(first.token_ids, 4))
    for tokens in (list(range(1, 15)), list(range(1, 10)) + [99] * 7, [1, 2, 3, 4, 5], list(range(1, 13)), [0] * 9):
        later = Sequence(1, "1", tokens, SamplingParams(), 0.0)
        assert len(bm.get_computed_blocks(later)) * 4 == cached_prefix_tokens(tokens, keys, 4), tokens


# ---- bounded-load routing ----------------------------------------------------------------------------
def test_bounded_load_pick_is_the_bounded_routers_decision():
    rng = random.Random(1)
    router = PrefixAwareBounded(6, c=1.25)
    for _ in range(300):
        loads = [rng.randint(0, 9) for _ in range(6)]
        key = rng.getrandbits(64)
        assert router.route(key, loads) == bounded_load_pick(list(router.candidates(key)), loads, 1.25)
    assert bounded_load_pick([0, 1], [5, 0], 1.25) == 1           # the home is over ceil(1.25 * 6 / 2) = 4
    assert bounded_load_pick([3, 1, 0, 2], [0, 0, 0, 0], 1.0) == 3
