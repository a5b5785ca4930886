"""Paged KV block manager: ref-counted blocks, an LRU free list, exact prefix caching.

A block holds the K/V of `block_size` consecutive tokens of one sequence; a sequence's `block_table` lists
its block ids in order, so token position p lives in slot `block_table[p // block_size] * block_size +
p % block_size` of the paged cache `[num_blocks, block_size, Hkv, D]`. vLLM's verbs:

- `can_allocate` / `allocate`: admit a waiting sequence (reusing cached prefix blocks when possible);
- `may_append` / `append_slot`: grow a running sequence by the tokens it computes this step;
- `free`: return a finished or preempted sequence's blocks;
- `fork`: a new sequence (another sample of a request) shares its parent's blocks; a write into a block that
  someone else still holds first copies it (copy-on-write; `append_slot` returns the copies);
- `trim`: free the blocks past a sequence's computed tokens (slots reserved for lookahead tokens not kept).
A `None` in a block table marks a block kept off the device (by a preemption strategy); `listener`
hears when a block's last holder lets go and when a free block is reused (a KV store with per-block state).

Prefix caching: once a FULL block's K/V is computed, it is cached under the name of the prefix before it
(`parent_id`, a number given to each cached prefix and never reused) and its own token ids. A later sequence
whose tokens start with the same blocks shares them (ref_count += 1) instead of recomputing them. A hit must
match that key exactly: `hash_block` only says where to look, so a hash collision costs a miss, never a block
computed after another prefix (vLLM's CVE-2025-25183); by induction over the blocks a hit is the exact prefix.
A freed block keeps its key and stays in the free list, still reusable on a hit, until an allocation takes it
(LRU eviction: the free list is ordered least recently freed first, and blocks without a key are put at its
front so they go first).

Other prefix caches (one at token granularity, `engine.features` registers it) subclass this one by
overriding `_is_cached`, `_uncache`, `match_prefix`, `cache_full_blocks` and `free`.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence as Seq

if TYPE_CHECKING:
    from llmso_lab.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


ROOT = 0   # the prefix id before a sequence's first block; cached prefixes are numbered from 1


def hash_block(parent_id: int, token_ids: tuple[int, ...]) -> int:
    """Where a full block sits in the prefix cache: a hash of its parent prefix's id and its token ids.
    Different blocks may collide; a hit is decided by the exact key (see `BlockManager._lookup`)."""
    return hash((parent_id, token_ids))


def block_hash_chain(token_ids: Seq[int], block_size: int) -> list[int]:
    """Prefix-cache keys of the FULL blocks of `token_ids` (vLLM's hash chain): key i = hash((key i-1, tokens of
    block i)), key -1 = ROOT. A key names the block's tokens AND everything before them, as its K/V depends on all
    of them (causal attention). A partial last block has no key. (`BlockManager` chains prefix ids, not hashes,
    so that a hash collision can never return a wrong block; the idea is the same.)"""
    keys, parent = [], ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, tuple(token_ids[start:start + block_size]))
        keys.append(parent)
    return keys


def cached_prefix_tokens(token_ids: Seq[int], cached_keys: Iterable[int], block_size: int) -> int:
    """Tokens of `token_ids` a prefix cache holding `cached_keys` (`block_hash_chain` keys) can serve: whole leading
    blocks while their keys are cached. At most (len - 1) // block_size blocks, as in `get_computed_blocks`: the last
    token is always computed, for the logits that sample the next one."""
    cached = cached_keys if isinstance(cached_keys, (set, frozenset, dict)) else set(cached_keys)
    hits = 0
    for key in block_hash_chain(token_ids, block_size)[:(len(token_ids) - 1) // block_size]:
        if key not in cached:
            break
        hits += 1
    return hits * block_size


def rollback_blocks(block_table: Seq[int], block_size: int, num_tokens: int) -> tuple[list[int], list[int]]:
    """After a step with lookahead slots only the first `num_tokens` tokens of a sequence have valid K/V (its last
    token and the accepted guesses; rejected guesses' slots are past them): the blocks to keep (those holding any of
    them) and the blocks to free (only rejected guesses were written there), in table order. (Lecture 2-1, Lab 07.)"""
    keep = cdiv(num_tokens, block_size)
    return list(block_table[:keep]), list(block_table[keep:])


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None            # set when the block is full, computed and cached (prefix caching)
    parent_id: int = ROOT              # the cached prefix before it ...
    token_ids: tuple[int, ...] = ()    # ... and its tokens: the exact key a hit must match
    prefix_id: int | None = None       # the name of the prefix it ends (its children's parent_id); never reused


@dataclass(slots=True)
class PrefixMatch:
    """What the prefix cache holds of a sequence's start: full blocks to share, and (a cache at token granularity)
    a block holding the `num_tokens % block_size` cached tokens after them, to copy."""
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    partial_block: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = reuse first
        self.hash_to_block_id: dict[int, int] = {}
        self.next_prefix_id = itertools.count(ROOT + 1)
        self.num_queried_tokens = 0    # prefix-cache statistics, in tokens, counted at admission
        self.num_hit_tokens = 0
        self.num_evictions = 0
        self.num_cow_copies = 0        # blocks copied because a sequence wrote into a shared one
        self.listener = None   # told released(block, cached) / reused(block): a KV store with per-block state

    # ---- counters ------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now, including freed blocks that still cache a prefix."""
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_block_ids if self._is_cached(b))

    def _is_cached(self, block_id: int) -> bool:
        return self.blocks[block_id].hash is not None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    # ---- block-level primitives ----------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)   # least recently freed first
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} on the free list has ref_count {block.ref_count}"
        if self._is_cached(block_id):   # evict the prefix it cached
            self._uncache(block_id)
            self.num_evictions += 1
        block.ref_count = 1
        if self.listener is not None:
            self.listener.reused(block_id)
        return block_id

    def _uncache(self, block_id: int) -> None:
        """Forget the prefix a free block caches (it is being reused); its prefix id is never given out again."""
        block = self.blocks[block_id]
        del self.hash_to_block_id[block.hash]
        block.hash, block.parent_id, block.token_ids, block.prefix_id = None, ROOT, (), None

    def _share(self, block_id: int) -> None:
        """One more holder of a cached block (it leaves the free list if nobody held it)."""
        if self.blocks[block_id].ref_count == 0:
            del self.free_block_ids[block_id]
        self.blocks[block_id].ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None                      # most recently used end
            if not self._is_cached(block_id):                         # caches nothing: reuse it first
                self.free_block_ids.move_to_end(block_id, last=False)
            if self.listener is not None:
                self.listener.released(block_id, self._is_cached(block_id))

    def _lookup(self, parent_id: int, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding exactly `token_ids` after the prefix `parent_id`, or None."""
        block_id = self.hash_to_block_id.get(hash_block(parent_id, token_ids))
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block_id if block.parent_id == parent_id and block.token_ids == token_ids else None   # else: a collision

    def _cache_block(self, block_id: int, parent_id: int, token_ids: tuple[int, ...],
                     prefix_id: int | None = None) -> int | None:
        """Cache a full computed block (`token_ids` after prefix `parent_id`). Returns the id of the prefix it
        ends: its own new one (or `prefix_id`, the name this very content had before it left the device), or that of an
        equal block already cached (this one then stays private), or None when another block holds its hash
        (a collision: the prefix goes unnamed, its children uncached)."""
        same = self._lookup(parent_id, token_ids)
        if same is not None:
            return self.blocks[same].prefix_id
        h = hash_block(parent_id, token_ids)
        if h in self.hash_to_block_id:
            return None
        block = self.blocks[block_id]
        assert block.hash is None, f"block {block_id} is already cached under another key"
        block.hash, block.parent_id, block.token_ids = h, parent_id, token_ids
        block.prefix_id = prefix_id if prefix_id is not None else next(self.next_prefix_id)
        self.hash_to_block_id[h] = block_id
        return block.prefix_id

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _num_kv_tokens(self, seq: Sequence) -> int:
        """Computed tokens of `seq` its block table covers: all of them, less the blocks dropped from its table."""
        return seq.num_computed_tokens - seq.num_dropped_blocks * self.block_size

    def _shared_in_write_range(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Indices of the blocks `seq` will write this step's tokens into that another table also holds."""
        done = self._num_kv_tokens(seq)
        first, end = done // self.block_size, cdiv(done + num_new_tokens, self.block_size)
        return [i for i in range(first, min(end, len(seq.block_table))) if self.blocks[seq.block_table[i]].ref_count > 1]

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks `seq` needs to compute `num_new_tokens` more tokens: new ones, plus copies of shared ones."""
        grow = max(0, cdiv(self._num_kv_tokens(seq) + num_new_tokens, self.block_size) - len(seq.block_table))
        return grow + len(self._shared_in_write_range(seq, num_new_tokens))

    # ---- admission ---------------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of `seq.token_ids` (a lookup; changes nothing).

        At most `num_tokens - 1` tokens are taken from the cache: the last token must be computed to get
        logits to sample from, so a fully cached prompt recomputes its last block.
        """
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], ROOT
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self._lookup(parent, self._block_tokens(seq, i))
            if block_id is None:
                break
            hits.append(block_id)
            parent = self.blocks[block_id].prefix_id
        return hits

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The cached start of `seq` (a lookup; changes nothing): at most `num_tokens - 1` tokens, as above."""
        hits = self.get_computed_blocks(seq)
        return PrefixMatch(hits, len(hits) * self.block_size)

    def _as_match(self, computed: PrefixMatch | Seq[int]) -> PrefixMatch:
        return computed if isinstance(computed, PrefixMatch) else PrefixMatch(list(computed), len(computed) * self.block_size)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed: PrefixMatch | Seq[int] = ()) -> bool:
        """Can `seq` (no blocks yet) get the cached prefix `computed` (a `PrefixMatch`, or cached block ids)
        plus blocks for `num_new_tokens` more?"""
        m = self._as_match(computed)
        needed = cdiv(m.num_tokens + num_new_tokens, self.block_size) - len(m.blocks)
        held = m.blocks + ([m.partial_block] if m.partial_block is not None else [])
        revived = sum(1 for b in set(held) if self.blocks[b].ref_count == 0)  # they leave the free list (a while)
        return needed + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, computed: PrefixMatch | Seq[int] = ()) -> list[tuple[int, int]]:
        """Give a waiting sequence its cached prefix and fresh blocks for `num_new_tokens` tokens. Returns the
        (source, destination) block copies to do before the forward: a match's partly cached block."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks"
        m = self._as_match(computed)
        assert self.can_allocate(seq, num_new_tokens, m)
        for block_id in m.blocks:
            self._share(block_id)
            seq.block_table.append(block_id)
            seq.prefix_ids.append(self.blocks[block_id].prefix_id)
        copies = []
        if m.partial_block is not None:   # its first num_tokens % block_size tokens are ours: copy, then append
            self._share(m.partial_block)   # held while a fresh block is taken, so that cannot evict it
            seq.block_table.append(self._take_free_block())
            self._release(m.partial_block)
            copies.append((m.partial_block, seq.block_table[-1]))
        seq.num_computed_tokens = seq.num_cached_tokens = m.num_tokens
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += seq.num_cached_tokens
        return copies + self.append_slot(seq, num_new_tokens)

    # ---- growth ------------------------------------------------------------------------------
    def may_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """Are there enough free blocks for `seq` to compute `num_new_tokens` more tokens?"""
        return self._blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def append_slot(self, seq: Sequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Grow `seq.block_table` to cover its next `num_new_tokens` tokens. A block those tokens go into that
        another sequence still holds is copied first (copy-on-write): `seq` gets the copy and the other holders
        keep the original. Returns the (source block, destination block) copies to do before the forward."""
        assert self._blocks_needed(seq, num_new_tokens) <= self.num_free_blocks, "call may_append first"
        copies = []
        for i in self._shared_in_write_range(seq, num_new_tokens):
            src = seq.block_table[i]
            seq.block_table[i] = self._take_free_block()
            self._release(src)                    # still held by the others: ref_count stays >= 1
            copies.append((src, seq.block_table[i]))
        grow = cdiv(self._num_kv_tokens(seq) + num_new_tokens, self.block_size) - len(seq.block_table)
        seq.block_table.extend(self._take_free_block() for _ in range(grow))
        self.num_cow_copies += len(copies)
        return copies

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past `seq`'s computed tokens (reserved this step for lookahead tokens that were not kept).
        They were taken for this step, so nothing else holds or caches them."""
        seq.block_table[:], freed = rollback_blocks(seq.block_table, self.block_size, seq.num_computed_tokens)
        for block_id in reversed(freed):
            assert self.blocks[block_id].ref_count == 1 and not self._is_cached(block_id), f"block {block_id} is shared"
            self._release(block_id)

    def fork(self, parent: Sequence, child: Sequence, share: bool = True) -> list[tuple[int, int]]:
        """`child` (holding no blocks) continues from `parent`'s computed tokens. share=True: it holds the same
        blocks (ref_count += 1); a later write into a shared block copies it then (`append_slot`).
        share=False: every block is copied now (a system without sharing; needs free blocks, see `can_fork`).
        Returns the (source block, destination block) copies to do before the next forward."""
        assert not child.block_table and None not in parent.block_table, "fork a running parent into an empty child"
        child.num_computed_tokens, child.prefix_ids = parent.num_computed_tokens, list(parent.prefix_ids)
        child.num_dropped_blocks = parent.num_dropped_blocks
        copies = []
        for block_id in parent.block_table:
            if share:
                self._share(block_id)
                child.block_table.append(block_id)
            else:
                child.block_table.append(self._take_free_block())
                copies.append((block_id, child.block_table[-1]))
        return copies

    def can_fork(self, parent: Sequence, share: bool = True) -> bool:
        return share or len(parent.block_table) <= self.num_free_blocks

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Cache each block of `seq` that is now full and computed, so later sequences can share it."""
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.prefix_ids), seq.num_computed_tokens // self.block_size):
            parent = seq.prefix_ids[i - 1] if i else ROOT
            seq.prefix_ids.append(None if parent is None else
                                  self._cache_block(seq.block_table[i], parent, self._block_tokens(seq, i)))

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s blocks. Last blocks first, so the prefix blocks stay cached longest."""
        assert None not in seq.block_table, "bring the sequence's blocks back to the device first"
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.prefix_ids.clear()
        seq.num_dropped_blocks = 0

    # ---- checks ------------------------------------------------------------------------------
    def check_invariants(self, holders: Iterable[Sequence] = ()) -> None:
        """Assert the bookkeeping is consistent. `holders`: every sequence holding blocks (running, or preempted with
        its KV kept elsewhere: it still holds the blocks it shares)."""
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids)
        refs = [0] * self.num_blocks
        for seq in holders:
            for block_id in seq.block_table:
                if block_id is not None:
                    refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]} holders"
            assert (block.ref_count == 0) == (block.block_id in free), f"block {block.block_id} free-list mismatch"
        for h, block_id in self.hash_to_block_id.items():
            block = self.blocks[block_id]
            assert block.hash == h == hash_block(block.parent_id, block.token_ids) and block.prefix_id is not None
