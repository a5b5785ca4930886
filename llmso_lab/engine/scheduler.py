"""Scheduler: steps 1-3 of the lecture's loop (retire, count free blocks, admit under a token budget).

Continuous batching (iteration-level scheduling, Orca / vLLM): every step,
  (a) running sequences get their next tokens, decodes first, then unfinished prefill chunks; a sequence
      that cannot get a KV block preempts a victim chosen by the policy (possibly itself);
  (b) preempted sequences whose KV was kept elsewhere come back, then waiting requests are admitted in policy
      order, each taking a prefill chunk from what is left of the `max_num_batched_tokens` budget (the whole prompt
      or nothing when chunked prefill is off), until `max_num_seqs` run or the budget or the blocks run out.

Seams (`engine.features` fills them): `preemption`, what happens to a victim (by default its KV is dropped and it
is recomputed later: `Recompute`); `growth`, which may cap a sequence's tokens this step and free blocks before it
grows; `lookahead`, extra KV slots a decoding sequence reserves after its last token and how the tokens emitted into
them are accepted. Batching modes that form whole batches instead subclass this class.

The rules shared with the simulator (`llmso_lab.sim`) live in `llmso_lab.batching` (token budget, what a
decode is) and `llmso_lab.policies` (order and victims).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from llmso_lab.batching import prefill_chunk
from llmso_lab.engine.policy import SchedulingPolicy
from llmso_lab.engine.sequence import Sequence, SequenceStatus
from llmso_lab.kv.block_manager import BlockManager

if TYPE_CHECKING:
    from llmso_lab.engine.config import EngineConfig

Mapping = list[tuple[int, int]]


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int        # real tokens computed this step; their K/V goes into the cache
    num_pad_tokens: int = 0    # a lock-step batch: padding up to the longest prompt, computed and discarded
    idle: bool = False         # a lock-step batch: a finished row that still occupies (and costs) its slot
    num_lookahead: int = 0     # KV slots reserved after the last token for tokens guessed this step
    lookahead_token_ids: list[int] = field(default_factory=list)   # the guesses put into them (in num_new_tokens)

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
    resumed: list[Sequence] = field(default_factory=list)       # came back with their KV (a preemption strategy's)
    moves: list[tuple[str, Mapping]] = field(default_factory=list)   # KV store operations of the strategies, in order
    blocks_to_copy: Mapping = field(default_factory=list)       # (device block, device block): copy-on-write

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_query_tokens for item in self.scheduled)

    def block_moves(self) -> list[tuple[str, Mapping]]:
        """The KV store operations of this step, in the order they must run: the strategies' moves (taking blocks off
        the device before the forward overwrites them, then bringing others back), then copy-on-write copies."""
        return [(op, m) for op, m in (*self.moves, ("copy_blocks", self.blocks_to_copy)) if m]


class Recompute:
    """The default preemption strategy: a victim's KV is dropped; it waits and is prefilled again (recomputed)."""
    offloaded: tuple = ()   # sequences preempted with their KV kept elsewhere: none

    def preempt(self, scheduler: Scheduler, victim: Sequence, out: SchedulerOutput) -> bool:
        return False   # not kept: the scheduler drops the KV

    def resume(self, scheduler: Scheduler, out: SchedulerOutput, budget: int, sched: dict, now: float) -> int:
        return budget

    def holds_back_admissions(self) -> bool:
        return False

    def forget(self, seq: Sequence) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def check_invariants(self) -> None:
        pass


class Scheduler:
    """Steps 1-3 over the engine's queues. Built from the `EngineConfig`; owns the block manager and the policy."""

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset(),
                 clock: Callable[[], float] = time.perf_counter, block_manager: BlockManager | None = None,
                 preemption=None) -> None:
        assert config.num_kv_blocks is not None and config.max_model_len is not None, "call config.resolve first"
        self.config, self.eos_token_ids, self.clock = config, eos_token_ids, clock
        self.block_manager = block_manager or BlockManager(config.num_kv_blocks, config.block_size,
                                                           config.enable_prefix_caching)
        self.policy = SchedulingPolicy(config.scheduling_policy, config.sjf_predictor, config.sjf_aging)
        self.preemption = preemption or Recompute()
        self.growth = None      # .cap(seq, n) -> n: this step's tokens for seq, after freeing what it may free
        self.lookahead = None   # .slots(seq) -> k, .accept(scheduler, item, tokens, now): see the module doc
        # Queue order carries no meaning: every read orders the queue by the policy (`policy.order`).
        self.waiting: list[Sequence] = []   # new, or preempted by recompute
        self.running: list[Sequence] = []
        self.num_preemptions_total = self.num_recomputes = 0

    @property
    def offloaded(self) -> list[Sequence]:
        """Preempted sequences whose KV is kept off the device (they still hold the blocks they share)."""
        return list(self.preemption.offloaded)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.preemption.offloaded)

    def stats(self) -> dict:
        return {"num_preemptions_total": self.num_preemptions_total, "num_preemptions_recompute": self.num_recomputes,
                **self.preemption.stats()}

    # ---- step 1: retire ------------------------------------------------------------------------
    def retire(self) -> list[Sequence]:
        """Remove sequences that finished in the previous step and return their KV blocks."""
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
        self._schedule(out, now)
        for item in out.scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        return out

    def chunk(self, remaining: int, budget: int) -> int:
        """Tokens of a prompt (`remaining` still to compute) that fit in `budget` this step."""
        return prefill_chunk(remaining, budget, self.config.enable_chunked_prefill)

    def _cap(self, seq: Sequence, n: int) -> int:
        return n if self.growth is None else self.growth.cap(seq, n)

    def _schedule(self, out: SchedulerOutput, now: float) -> None:
        bm, max_num_seqs = self.block_manager, self.config.max_num_seqs
        budget, sched = self.config.max_num_batched_tokens, {}   # seq_id -> ScheduledSeq, in scheduling order
        # (a) running sequences, decodes first: each needs KV room for its next token(s)
        decodes = [s for s in self.running if not s.is_prefill]
        prefills = [s for s in self.running if s.is_prefill]
        for seq in self.policy.order(decodes, now) + self.policy.order(prefills, now):
            if seq.status is not SequenceStatus.RUNNING:
                continue   # preempted as a victim earlier in this loop
            n = self._cap(seq, self.chunk(seq.num_uncomputed_tokens, budget))
            if n == 0:
                continue
            k = 0 if seq.is_prefill or self.lookahead is None else min(self.lookahead.slots(seq), budget - n)
            while not bm.may_append(seq, n + k):
                victim = self.policy.victim(self.running, now)
                budget += self._preempt(victim, sched, out)
                if victim is seq:
                    break
            else:
                out.blocks_to_copy += bm.append_slot(seq, n + k)
                sched[seq.seq_id] = ScheduledSeq(seq, n, num_lookahead=k)
                budget -= n + k
        # (b) bring back the sequences whose KV was kept, then admit waiting ones; neither in a step that had to
        # preempt, and no new request while the strategy holds admissions back
        if not out.preempted:
            budget = self.preemption.resume(self, out, budget, sched, now)
        if not out.preempted and not self.preemption.holds_back_admissions():
            for seq in self.policy.order((s for s in self.waiting if s.arrival_time <= now), now):
                if len(self.running) >= max_num_seqs:
                    break
                cached = bm.match_prefix(seq)   # prefix-cache hits
                n = self._cap(seq, self.chunk(seq.num_tokens - cached.num_tokens, budget))
                if n == 0 or not bm.can_allocate(seq, n, cached):
                    break
                self.waiting.remove(seq)
                out.blocks_to_copy += bm.allocate(seq, n, cached)
                self.start_running(seq, n, sched)
                budget -= n
        out.scheduled = sorted(sched.values(), key=lambda item: item.num_query_tokens > 1)   # decodes first
        out.num_decodes = sum(item.num_query_tokens == 1 for item in out.scheduled)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens

    def start_running(self, seq: Sequence, n: int, sched: dict[int, ScheduledSeq]) -> None:
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
        if not self.preemption.preempt(self, victim, out):   # not kept elsewhere: drop the KV, prefill again later
            self.block_manager.free(victim)
            victim.num_computed_tokens = 0
            victim.status = SequenceStatus.WAITING
            self.waiting.append(victim)
            self.num_recomputes += 1
        return item.num_new_tokens if item else 0

    # ---- after the forward -----------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[int, int | list[int]], now: float) -> None:
        """Record what the forward computed, append sampled tokens (a list for a row with lookahead slots), mark
        finished sequences."""
        for item in out.scheduled:
            if item.idle:
                continue
            seq = item.seq
            if item.num_lookahead:   # the last token and the lookahead tokens: the strategy accepts what it keeps
                self.lookahead.accept(self, item, sampled[seq.seq_id], now)
                continue
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if seq.seq_id in sampled:
                self.append_token(seq, sampled[seq.seq_id], now)

    def append_token(self, seq: Sequence, token_id: int, now: float) -> None:
        seq.append_token(token_id, now)
        self._check_stop(seq)

    # ---- sequences that share blocks: n > 1 samples, search groups -------------------------------
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
        """Drop `seq` from whichever queue holds it and return its KV blocks (e.g. a pruned search branch)."""
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        self.preemption.forget(seq)
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
        self.preemption.check_invariants()
        self.block_manager.check_invariants(holders=[*self.running, *self.offloaded])
