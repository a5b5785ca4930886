"""The engine's radix prefix cache (`prefix_caching_algo="radix"`, SGLang's RadixAttention, lecture 1-2): the block
manager with its hash chain over full blocks replaced by a radix tree over tokens (`kv.radix.RadixTree`).

A match may end inside a block; that block's cached tokens are then copied into a fresh block (copy-on-write at
token granularity, `PrefixMatch.partial_block`) instead of recomputed. Sequences insert their computed tokens when a
block fills and when they are freed (the partly filled last block too). Eviction is the same LRU over free blocks;
a sequence frees its last blocks first, so the tree loses its leaves first, and reusing a block cuts the tree
there (the tokens after it on that path are useless without it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from llmso_lab.kv.block_manager import BlockManager, PrefixMatch, cdiv
from llmso_lab.kv.radix import RadixTree

if TYPE_CHECKING:
    from llmso_lab.engine.sequence import Sequence


class RadixBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.radix = RadixTree(block_size)
        self.inserted: dict[Sequence, int] = {}   # sequence -> its leading tokens already put in the tree

    def _is_cached(self, block_id: int) -> bool:
        return block_id in self.radix.holders

    def _uncache(self, block_id: int) -> None:
        """Cut the tree where this block was; blocks below it that are free cache nothing now: reuse them first."""
        for other in self.radix.evict_block(block_id) - {block_id}:
            if self.blocks[other].ref_count == 0:
                self.free_block_ids.move_to_end(other, last=False)

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The cached start of `seq` at token granularity: at most `num_tokens - 1` tokens (the last is computed)."""
        m = self.radix.match(seq.token_ids[:seq.num_tokens - 1])
        blocks, full = self.radix.blocks_of(m), m.num_tokens // self.block_size
        return PrefixMatch(blocks[:full], m.num_tokens, blocks[full] if m.num_tokens % self.block_size else None)

    def allocate(self, seq: Sequence, num_new_tokens: int, computed=()) -> list[tuple[int, int]]:
        copies = super().allocate(seq, num_new_tokens, computed)
        self.inserted[seq] = seq.num_cached_tokens   # the matched tokens are in the tree already
        return copies

    def cache_full_blocks(self, seq: Sequence) -> None:
        if self.enable_prefix_caching:
            self._insert(seq, seq.num_computed_tokens // self.block_size * self.block_size)

    def _insert(self, seq: Sequence, num_tokens: int) -> None:
        """Put `seq`'s first `num_tokens` (computed) tokens and their blocks in the radix tree."""
        if num_tokens > self.inserted.get(seq, 0):
            self.radix.insert(seq.token_ids[:num_tokens], seq.block_table)
            self.inserted[seq] = num_tokens

    def free(self, seq: Sequence) -> None:
        if None not in seq.block_table:
            self._insert(seq, seq.num_computed_tokens)   # the partly filled last block too
        super().free(seq)
        self.inserted.pop(seq, None)

    def check_invariants(self, holders: Iterable[Sequence] = ()) -> None:
        super().check_invariants(holders)
        for node in self.radix.nodes():
            assert all(node in self.radix.holders[b] for b in node.blocks), "radix holders out of date"
            assert len(node.blocks) == cdiv(node.end, self.block_size) - node.start // self.block_size
