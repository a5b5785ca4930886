"""Scheduler: steps 1-3 of the lecture's loop (retire, count free blocks, admit under a token budget).

Continuous batching (iteration-level scheduling, Orca / vLLM): every step,
  (a) running sequences get their next tokens, decodes first, then unfinished prefill chunks; a sequence
      that cannot get a KV block preempts a victim chosen by the policy (possibly itself);
  (b) swapped-out sequences come back, then waiting requests are admitted in policy order, each taking a
      prefill chunk from what is left of the `max_num_batched_tokens` budget (the whole prompt or nothing
      when chunked prefill is off), until `max_num_seqs` run or the budget or the blocks run out.
Under `kv_eviction` (StreamingLLM, `llmso_lab.kv.streaming`) a sequence's chunk is first capped so that it stays
within sinks + window + 1 blocks, and the oldest non-sink blocks past that are freed before its free-block check.
Static / dynamic batching form a batch only when the previous one has completely finished: all its
prompts are prefilled together, padded to the longest, then decoded in lock-step; a finished row keeps its
slot and is still computed (idle) until the whole batch is done (Hugging Face `generate`,
FasterTransformer). Dynamic waits to form a batch until it is full or the oldest request has waited
`batch_window_s`. Like those systems, a batch reserves a rectangular KV cache up front: every row holds
blocks for the batch's longest prompt + its largest max_tokens (`llmso_lab.batching.static_batch`), so
these modes never preempt; the token budget and chunked prefill are iteration-level knobs and do not apply.

The rules shared with the simulator (`llmso_lab.sim`) live in `llmso_lab.batching` (token budget, what a
decode is, the static reservation) and `llmso_lab.policies` (order and victims).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from llmso_lab.batching import prefill_chunk, static_batch
from llmso_lab.engine.policy import SchedulingPolicy
from llmso_lab.engine.sequence import Sequence, SequenceStatus
from llmso_lab.kv.block_manager import BlockManager
from llmso_lab.kv.streaming import max_chunk_tokens, num_blocks_to_evict

if TYPE_CHECKING:
    from llmso_lab.engine.config import EngineConfig


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int        # real tokens computed this step; their K/V goes into the cache
    num_pad_tokens: int = 0    # static/dynamic: padding up to the longest prompt, computed and discarded
    idle: bool = False         # static/dynamic: a finished row that still occupies (and costs) its slot
    num_lookahead: int = 0     # speculative decoding: KV slots reserved for draft tokens after the last token
    lookahead_token_ids: list[int] = field(default_factory=list)   # the drafts proposed into them (in num_new_tokens)

    @property
    def num_query_tokens(self) -> int:
        return 1 if self.idle else self.num_new_tokens + self.num_pad_tokens

    @property
    def sample(self) -> bool:
        """Does this step reach the end of the sequence's tokens (so a new token is sampled)?"""
        return (not self.idle and
                self.seq.num_computed_tokens + self.num_new_tokens - len(self.lookahead_token_ids) == self.seq.num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)   # the num_decodes one-token items first, then prefills
    num_decodes: int = 0   # the batch layout the model runner and the attention backends rely on
    preempted: list[Sequence] = field(default_factory=list)
    swapped_in: list[Sequence] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, swap block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (swap block, device block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)       # (device block, device block): copy-on-write

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_query_tokens for item in self.scheduled)

    def block_moves(self) -> list[tuple[str, list[tuple[int, int]]]]:
        """The KV store operations of this step, in the order they must run: swap-outs before the forward overwrites
        those blocks, then swap-ins, then copy-on-write copies (after the swaps freed and filled blocks)."""
        moves = [("swap_out", self.blocks_to_swap_out), ("swap_in", self.blocks_to_swap_in),
                 ("copy_blocks", self.blocks_to_copy)]
        return [(op, mapping) for op, mapping in moves if mapping]


class Scheduler:
    """Steps 1-3 over the engine's queues. Built from the `EngineConfig`; owns the block manager and the policy."""

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset(),
                 clock: Callable[[], float] = time.perf_counter) -> None:
        assert config.num_kv_blocks is not None and config.max_model_len is not None, "call config.resolve first"
        self.config, self.eos_token_ids, self.clock = config, eos_token_ids, clock
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                          config.swap_space_blocks, config.prefix_caching_algo)
        self.policy = SchedulingPolicy(config.scheduling_policy, config.sjf_predictor, config.sjf_aging)
        # Queue order carries no meaning: every read orders the queue by the policy (`policy.order`).
        self.waiting: list[Sequence] = []   # new, or preempted by recompute
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []   # preempted by swap
        self.num_preemptions_total = self.num_recomputes = self.num_swaps = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- step 1: retire ------------------------------------------------------------------------
    def retire(self) -> list[Sequence]:
        """Remove sequences that finished in the previous step and return their KV blocks."""
        if self.config.batching != "continuous" and not all(s.is_finished for s in self.running):
            return []   # a static batch keeps every slot until its longest row is done
        done = [s for s in self.running if s.is_finished]
        now = self.clock()
        for seq in done:
            self.block_manager.free(seq)
            self.running.remove(seq)
            seq.finish_time = now
            self.policy.on_finish(seq)
        return done

    # ---- step 3: admit ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now, out = self.clock(), SchedulerOutput()
        if self.config.batching == "continuous":
            self._schedule_continuous(out, now)
        else:
            self._schedule_static(out, now)
        for item in out.scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        return out

    def _chunk(self, remaining: int, budget: int) -> int:
        return prefill_chunk(remaining, budget, self.config.enable_chunked_prefill)

    def _schedule_continuous(self, out: SchedulerOutput, now: float) -> None:
        bm, max_num_seqs = self.block_manager, self.config.max_num_seqs
        budget, sched = self.config.max_num_batched_tokens, {}   # seq_id -> ScheduledSeq, in scheduling order
        # (a) running sequences, decodes first: each needs KV room for its next token(s)
        decodes = [s for s in self.running if not s.is_prefill]
        prefills = [s for s in self.running if s.is_prefill]
        for seq in self.policy.order(decodes, now) + self.policy.order(prefills, now):
            if seq.status is not SequenceStatus.RUNNING:
                continue   # preempted as a victim earlier in this loop
            n = self._evict(seq, self._chunk(seq.num_uncomputed_tokens, budget))
            if n == 0:
                continue
            lookahead = min(self._lookahead(seq), budget - n) if not seq.is_prefill else 0
            while not bm.may_append(seq, n + lookahead):
                victim = self.policy.victim(self.running, now)
                budget += self._preempt(victim, sched, out)
                if victim is seq:
                    break
            else:
                out.blocks_to_copy += bm.append_slot(seq, n + lookahead)
                sched[seq.seq_id] = ScheduledSeq(seq, n, num_lookahead=lookahead)
                budget -= n + lookahead
        # (b) bring back swapped sequences, then admit waiting ones; neither in a step that had to preempt,
        # and no new request while a swapped one is still out (vLLM: swapped sequences come back first)
        if not out.preempted:
            for seq in self.policy.order(self.swapped, now):
                n = self._chunk(seq.num_uncomputed_tokens, budget)
                if len(self.running) >= max_num_seqs or n == 0 or not bm.can_swap_in(seq, n):
                    break
                self.swapped.remove(seq)
                out.blocks_to_swap_in += bm.swap_in(seq)
                out.blocks_to_copy += bm.append_slot(seq, n)
                self._start_running(seq, n, sched)
                out.swapped_in.append(seq)
                budget -= n
        if not out.preempted and not self.swapped:
            for seq in self.policy.order((s for s in self.waiting if s.arrival_time <= now), now):
                if len(self.running) >= max_num_seqs:
                    break
                cached = bm.match_prefix(seq)   # prefix-cache hits
                n = self._evict(seq, self._chunk(seq.num_tokens - cached.num_tokens, budget))
                if n == 0 or not bm.can_allocate(seq, n, cached):
                    break
                self.waiting.remove(seq)
                out.blocks_to_copy += bm.allocate(seq, n, cached)
                self._start_running(seq, n, sched)
                budget -= n
        out.scheduled = sorted(sched.values(), key=lambda item: item.num_query_tokens > 1)   # decodes first
        out.num_decodes = sum(item.num_query_tokens == 1 for item in out.scheduled)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens

    def _evict(self, seq: Sequence, n: int) -> int:
        """kv_eviction (StreamingLLM, `kv.streaming`): cap this step's `n` tokens of `seq` so that it holds at most
        sinks + window + 1 blocks once its evictable blocks are gone, drop the oldest non-sink blocks that would
        exceed that (before the free-block check, so they count as free), and return the capped `n`."""
        ev = self.config.eviction
        if ev is None or n == 0:
            return n
        bs = self.config.block_size
        n = min(n, max_chunk_tokens(seq.num_computed_tokens, bs, ev))
        k = num_blocks_to_evict(seq.num_computed_tokens, n, seq.num_dropped_blocks, bs, ev)
        if k:
            self.block_manager.evict_blocks(seq, ev.num_sink_blocks, k)
        return n

    def _lookahead(self, seq: Sequence) -> int:
        """Speculative decoding: draft slots for a decoding `seq` — num_speculative_tokens, fewer near its
        max_tokens or max_model_len (drafts past them could never be used); none for beams."""
        k = self.config.num_speculative_tokens
        if not k or seq.beam is not None:
            return 0
        return max(0, min(k, seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
                          self.config.max_model_len - seq.num_tokens))

    def _start_running(self, seq: Sequence, n: int, sched: dict[int, ScheduledSeq]) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        sched[seq.seq_id] = ScheduledSeq(seq, n)

    def _preempt(self, victim: Sequence, sched: dict[int, ScheduledSeq], out: SchedulerOutput) -> int:
        """Take `victim` off the device. Returns the token budget it gives back."""
        self.running.remove(victim)
        item = sched.pop(victim.seq_id, None)
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        out.preempted.append(victim)
        # beams are forked while preempted (see beam_search), which needs their KV dropped, not swapped
        if self.config.preemption_mode == "swap" and victim.beam is None and self.block_manager.can_swap_out(victim):
            out.blocks_to_swap_out += self.block_manager.swap_out(victim)   # KV is kept, in the CPU pool
            victim.status = SequenceStatus.SWAPPED
            self.swapped.append(victim)
            self.num_swaps += 1
        else:   # recompute (also the fallback when the swap pool is full): drop the KV, prefill again later
            self.block_manager.free(victim)
            victim.num_computed_tokens = 0
            victim.status = SequenceStatus.WAITING
            self.waiting.append(victim)
            self.num_recomputes += 1
        return item.num_new_tokens if item else 0

    def _schedule_static(self, out: SchedulerOutput, now: float) -> None:
        bm, cfg = self.block_manager, self.config
        if not self.running:   # the previous batch is retired (every block is free): form the next one
            arrived = [s for s in self.policy.order(self.waiting, now) if s.arrival_time <= now]
            if not arrived:
                return
            if (cfg.batching == "dynamic" and len(arrived) < cfg.max_num_seqs
                    and now - min(s.arrival_time for s in arrived) < cfg.batch_window_s):
                return   # wait for the batch to fill or for the window to close
            rows, reserve = static_batch([(s.num_prompt_tokens, s.sampling_params.max_tokens) for s in arrived],
                                         cfg.max_num_seqs, bm.num_free_blocks, bm.block_size, cfg.max_model_len)
            for seq in arrived[:rows]:   # each row's KV for the whole rectangle, reserved now (less its cached prefix)
                cached = bm.match_prefix(seq)
                self.waiting.remove(seq)
                out.blocks_to_copy += bm.allocate(seq, reserve - cached.num_tokens, cached)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
        if any(s.is_prefill for s in self.running):   # first step of the batch: padded prefill
            longest = max(s.num_uncomputed_tokens for s in self.running)
            out.scheduled = [ScheduledSeq(s, s.num_uncomputed_tokens, longest - s.num_uncomputed_tokens)
                             for s in self.running]
            out.num_decodes = len(self.running) if longest == 1 else 0
        else:                                          # lock-step decode; finished rows idle
            out.scheduled = [ScheduledSeq(s, 0, idle=True) if s.is_finished else ScheduledSeq(s, 1)
                             for s in self.running]
            out.num_decodes = len(out.scheduled)

    # ---- after the forward -----------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[int, int | list[int]], now: float) -> None:
        """Record what the forward computed, append sampled tokens (a list per speculative decode), mark finished
        sequences."""
        for item in out.scheduled:
            if item.idle:
                continue
            seq = item.seq
            if item.num_lookahead:   # speculative: the last token, then one more per accepted draft
                self._update_speculative(item, sampled[seq.seq_id], now)
                continue
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if seq.seq_id in sampled:
                self.append_token(seq, sampled[seq.seq_id], now)

    def _update_speculative(self, item: ScheduledSeq, emitted: list[int], now: float) -> None:
        """A speculative decode emitted `emitted` (the accepted drafts, then one token from the target). The K/V
        of the last token and of each accepted draft is valid; the slots of rejected drafts are rolled back: the
        sequence's computed length stops before them (they are overwritten later) and the blocks only they
        used are freed. Tokens after a stop (EOS, max_tokens) are dropped."""
        seq = item.seq
        seq.num_computed_tokens += 1
        for j, token in enumerate(emitted):
            if j:
                seq.num_computed_tokens += 1     # draft j - 1 was accepted: its K/V (computed this step) is right
            self.append_token(seq, token, now)
            if seq.is_finished:
                break
        self.block_manager.trim(seq)
        self.block_manager.cache_full_blocks(seq)

    def append_token(self, seq: Sequence, token_id: int, now: float) -> None:
        seq.append_token(token_id, now)
        self._check_stop(seq)

    # ---- sequences that share blocks: n > 1 samples, beams --------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Add `child`, a copy of `parent`'s tokens, sharing `parent`'s KV blocks (copy-on-write) where it has any;
        a waiting parent (preempted, no KV) gives a waiting child. Returns the block copies to do now
        (`share_kv_blocks=False`: every block is copied at once)."""
        child.token_ids = list(parent.token_ids)
        child.first_scheduled_time = parent.first_scheduled_time
        if parent.status is SequenceStatus.WAITING or not parent.block_table:
            child.status = SequenceStatus.WAITING
            self.waiting.append(child)
            return []
        assert parent.status in (SequenceStatus.RUNNING, SequenceStatus.FINISHED), f"cannot fork a {parent.status} sequence"
        share = self.config.share_kv_blocks
        if not self.block_manager.can_fork(parent, share):
            raise RuntimeError(f"no free KV blocks to copy {len(parent.block_table)} blocks for a fork with "
                               "share_kv_blocks=False; raise num_kv_blocks or share the blocks")
        copies = self.block_manager.fork(parent, child, share)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        return copies

    def abort(self, seq: Sequence) -> None:
        """Drop `seq` from whichever queue holds it and return its KV blocks (a pruned beam)."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq)
        seq.status, seq.finish_time = SequenceStatus.FINISHED, self.clock()

    def _check_stop(self, seq: Sequence) -> None:
        sp, last = seq.sampling_params, seq.token_ids[-1]
        if (not sp.ignore_eos and last in self.eos_token_ids) or (sp.stop_token_ids and last in sp.stop_token_ids):
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.config.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.status = SequenceStatus.FINISHED

    def check_invariants(self) -> None:
        assert all(s.status is SequenceStatus.RUNNING or (s.is_finished and s.block_table) for s in self.running)
        assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in self.waiting)
        assert all(s.status is SequenceStatus.SWAPPED for s in self.swapped)
        self.block_manager.check_invariants(holders=self.running, swapped=self.swapped)
