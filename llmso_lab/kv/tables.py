"""Block tables by request id: a small front end to the engine's `BlockManager` (Lab 04, copy-on-write).

The engine keeps a `Sequence` per request and calls `BlockManager` at fixed points of its step; this class
gives the same bookkeeping a plain API keyed by sequence id, so it can be driven (and checked) by hand:

  allocate(seq_id, num_tokens)   a new sequence whose first `num_tokens` tokens get blocks (a prompt)
  fork(parent_id, child_id)      the child holds the parent's blocks too (ref_count + 1 each): n > 1, beams
  append(seq_id, num_tokens=1)   `num_tokens` more tokens: a block they go into that another sequence still
                                 holds is copied first (copy-on-write); returns how many blocks were copied
  free(seq_id)                   every block loses one holder; those nobody holds go back to the free list
  num_free_blocks()              blocks an allocation may take now
  ref_counts(seq_id)             how many sequences hold each block of its table, in table order

Running out of blocks raises `MemoryError` and changes nothing (the engine instead preempts someone, Lab 02).
Token ids do not matter here (no prefix caching): only how many tokens each sequence has. As in the engine,
`num_computed_tokens` is advanced after the blocks are found (there: after the forward pass wrote the K/V).
"""
from __future__ import annotations

import itertools

from llmso_lab.engine.sampling_params import SamplingParams
from llmso_lab.engine.sequence import Sequence
from llmso_lab.kv.block_manager import BlockManager, cdiv

__all__ = ["BlockAllocator"]


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.manager = BlockManager(num_blocks, block_size)
        self.seqs: dict[object, Sequence] = {}
        self._ids = itertools.count()

    def _seq(self, seq_id) -> Sequence:
        if seq_id not in self.seqs:
            raise KeyError(f"no sequence {seq_id!r}: allocate or fork it first")
        return self.seqs[seq_id]

    def _new(self, seq_id, num_tokens: int) -> Sequence:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} exists already")
        return Sequence(next(self._ids), str(seq_id), [0] * num_tokens, SamplingParams(), 0.0)

    def allocate(self, seq_id, num_tokens: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"a sequence starts with at least 1 token, got {num_tokens}")
        seq = self._new(seq_id, num_tokens)
        if not self.manager.can_allocate(seq, num_tokens):
            raise MemoryError(f"{cdiv(num_tokens, self.manager.block_size)} blocks needed, "
                              f"{self.manager.num_free_blocks} free")
        self.manager.allocate(seq, num_tokens)
        seq.num_computed_tokens += num_tokens
        self.seqs[seq_id] = seq

    def fork(self, parent_id, child_id) -> None:
        parent = self._seq(parent_id)
        child = self._new(child_id, parent.num_tokens)
        child.token_ids = list(parent.token_ids)
        self.manager.fork(parent, child, share=True)
        self.seqs[child_id] = child

    def append(self, seq_id, num_tokens: int = 1) -> int:
        seq = self._seq(seq_id)
        if not self.manager.may_append(seq, num_tokens):
            raise MemoryError(f"sequence {seq_id!r} needs more blocks than the {self.manager.num_free_blocks} free")
        copies = self.manager.append_slot(seq, num_tokens)
        seq.token_ids += [0] * num_tokens
        seq.num_computed_tokens += num_tokens
        return len(copies)

    def free(self, seq_id) -> None:
        self.manager.free(self._seq(seq_id))
        del self.seqs[seq_id]

    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    def ref_counts(self, seq_id) -> list[int]:
        return [self.manager.blocks[b].ref_count for b in self._seq(seq_id).block_table]
