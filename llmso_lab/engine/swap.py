"""Preemption by swap (vLLM's `preemption_mode="swap"`, lecture 1-2): a preempted sequence's KV blocks go to a host
(CPU) pool and come back later, instead of being dropped and recomputed.

- `SwapSpace`: the block-level part, beside the `BlockManager` whose blocks it moves. `swap_out` copies the blocks a
  sequence holds alone to the pool and releases them; blocks it shares with others stay on the device, still
  referenced (copying them would free nothing); blocks past its computed tokens hold no K/V yet and are just
  released. In the block table a swapped block becomes `None`; `tables[seq]` maps its index to its pool block.
  `swap_in` brings the sequence back; a block still in the prefix cache is shared again instead of copied.
- `SwapPreemption`: the scheduler's preemption strategy: a victim is swapped out when the pool has room (else, or for
  a sequence in a search group that forks while preempted, it is recomputed as by default); swapped sequences come
  back before any new request is admitted (vLLM's order). The KV store carries out the copies (`swap_out` /
  `swap_in` block moves, `engine.kv_cache`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from llmso_lab.engine.sequence import SequenceStatus
from llmso_lab.kv.block_manager import ROOT, BlockManager, cdiv

if TYPE_CHECKING:
    from llmso_lab.engine.sequence import Sequence


class SwapSpace:
    """The host pool's blocks and which sequence's block sits where."""

    def __init__(self, bm: BlockManager, num_swap_blocks: int) -> None:
        self.bm, self.num_swap_blocks = bm, num_swap_blocks
        self.free_ids: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.tables: dict[Sequence, dict[int, int]] = {}   # swapped sequence -> {block index: pool block}

    def _blocks_to_copy(self, seq: Sequence) -> list[int]:
        """Indices of the blocks a swap-out copies: those with computed K/V that `seq` holds alone."""
        num_with_kv = cdiv(seq.num_computed_tokens, self.bm.block_size)
        return [i for i, block_id in enumerate(seq.block_table[:num_with_kv]) if self.bm.blocks[block_id].ref_count == 1]

    def can_swap_out(self, seq: Sequence) -> bool:
        """Does the host pool have room for the blocks `seq` holds alone?"""
        return len(self._blocks_to_copy(seq)) <= len(self.free_ids)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Preempt `seq` by swap: the blocks it holds alone are copied to the CPU pool and released (a cached one
        stays in the prefix cache until evicted); blocks it shares stay on the device, still referenced; blocks
        past its computed tokens hold no K/V yet and are just released. `block_table[i]` becomes None for a block
        now in the CPU pool at `tables[seq][i]`. Returns the (device block, swap block) copies to do before the
        next forward."""
        assert self.can_swap_out(seq)
        self.tables[seq] = {}
        copied, num_with_kv = set(self._blocks_to_copy(seq)), cdiv(seq.num_computed_tokens, self.bm.block_size)
        released = [b for i, b in enumerate(seq.block_table) if i in copied or i >= num_with_kv]
        copies = []
        for i in sorted(copied):
            self.tables[seq][i] = self.free_ids.pop()
            copies.append((seq.block_table[i], self.tables[seq][i]))
            seq.block_table[i] = None
        del seq.block_table[num_with_kv:]
        for block_id in reversed(released):   # last blocks first, as in free
            self.bm._release(block_id)
        return copies

    def _cached_copy(self, seq: Sequence, i: int) -> int | None:
        """A block in the prefix cache equal to `seq`'s block i (named by the prefix ids `seq` kept), or None."""
        if i >= len(seq.prefix_ids) or seq.prefix_ids[i] is None:
            return None
        return self.bm._lookup(seq.prefix_ids[i - 1] if i else ROOT, self.bm._block_tokens(seq, i))

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """Are there free blocks for `seq`'s swapped blocks not found in the prefix cache, for the cached ones
        nobody holds now, and for `num_new_tokens` more tokens?"""
        found = [self._cached_copy(seq, i) for i in self.tables.get(seq, {})]
        needed = sum(1 for b in found if b is None or self.bm.blocks[b].ref_count == 0)
        extra = max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.bm.block_size) - len(seq.block_table))
        bs = self.bm.block_size
        first, end = seq.num_computed_tokens // bs, cdiv(seq.num_computed_tokens + num_new_tokens, bs)
        cow = sum(1 for b in seq.block_table[first:end] if b is not None and self.bm.blocks[b].ref_count > 1)   # kept, shared
        return needed + extra + cow <= self.bm.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring `seq` back. A swapped block still in the prefix cache is shared again (no copy); the others get
        fresh blocks (cached again under their old key when it is free). Returns (swap block, device block) copies."""
        assert self.can_swap_in(seq, 0)
        found = {i: self._cached_copy(seq, i) for i in self.tables[seq]}
        for block_id in found.values():   # first, so that taking fresh blocks below cannot evict them
            if block_id is not None:
                self.bm._share(block_id)
        copies = []
        for i, swap_id in self.tables[seq].items():
            block_id = found[i]
            if block_id is None:
                block_id = self.bm._take_free_block()
                copies.append((swap_id, block_id))
                if i < len(seq.prefix_ids) and seq.prefix_ids[i] is not None:
                    self.bm._cache_block(block_id, seq.prefix_ids[i - 1] if i else ROOT,
                                         self.bm._block_tokens(seq, i), seq.prefix_ids[i])
            seq.block_table[i] = block_id
            self.free_ids.append(swap_id)
        del self.tables[seq]
        return copies

    def check_invariants(self, swapped: list[Sequence]) -> None:
        """Every swapped sequence's None entries are exactly its pool blocks; no pool block is lost or shared."""
        for seq in swapped:
            table = self.tables.get(seq, {})
            assert all((b is None) == (i in table) for i, b in enumerate(seq.block_table))
        ids = [i for seq in swapped for i in self.tables.get(seq, {}).values()]
        assert len(set(ids) | set(self.free_ids)) == len(ids) + len(self.free_ids) == self.num_swap_blocks


class SwapPreemption:
    """The scheduler's preemption strategy for `preemption_mode="swap"` (the default strategy recomputes)."""

    def __init__(self, bm: BlockManager, num_swap_blocks: int) -> None:
        self.space = SwapSpace(bm, num_swap_blocks)
        self.swapped: list[Sequence] = []   # preempted by swap: their KV sits in the host pool
        self.num_swaps = 0

    @property
    def offloaded(self) -> list[Sequence]:
        return self.swapped

    def preempt(self, scheduler, victim: Sequence, out) -> bool:
        """Swap `victim` out if the pool has room; False: recompute it instead. A sequence in a search group (beam
        search) is forked while preempted, which needs its KV dropped, not swapped."""
        if victim.group is not None or not self.space.can_swap_out(victim):
            return False
        out.moves.append(("swap_out", self.space.swap_out(victim)))   # KV is kept, in the host pool
        victim.status = SequenceStatus.PREEMPTED
        self.swapped.append(victim)
        self.num_swaps += 1
        return True

    def resume(self, scheduler, out, budget: int, sched: dict, now: float) -> int:
        """Bring swapped sequences back (policy order) while they fit; returns the token budget left."""
        bm = scheduler.block_manager
        for seq in scheduler.policy.order(self.swapped, now):
            n = scheduler.chunk(seq.num_uncomputed_tokens, budget)
            if len(scheduler.running) >= scheduler.config.max_num_seqs or n == 0 or not self.space.can_swap_in(seq, n):
                break
            self.swapped.remove(seq)
            out.moves.append(("swap_in", self.space.swap_in(seq)))
            out.blocks_to_copy += bm.append_slot(seq, n)
            scheduler.start_running(seq, n, sched)
            out.resumed.append(seq)
            budget -= n
        return budget

    def holds_back_admissions(self) -> bool:
        """No new request while a swapped one is still out (vLLM: swapped sequences come back first)."""
        return bool(self.swapped)

    def forget(self, seq: Sequence) -> None:
        """`seq` is dropped while swapped out (aborted): its pool blocks go back; the device blocks it still shares
        stay in its table for the scheduler to free."""
        if seq in self.swapped:
            self.swapped.remove(seq)
            self.space.free_ids.extend(self.space.tables.pop(seq, {}).values())
            seq.block_table[:] = [b for b in seq.block_table if b is not None]

    def stats(self) -> dict:
        return {"num_preemptions_swap": self.num_swaps}

    def check_invariants(self) -> None:
        assert all(s.status is SequenceStatus.PREEMPTED for s in self.swapped)
        self.space.check_invariants(self.swapped)
