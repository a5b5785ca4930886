"""Static and dynamic batching (`batching="static" | "dynamic"`, lecture 1-1): the baselines continuous batching
is measured against, as a scheduler that forms whole batches.

A batch is formed only when the previous one has completely finished: all its prompts are prefilled together,
padded to the longest, then decoded in lock-step; a finished row keeps its slot and is still computed (idle) until
the whole batch is done (Hugging Face `generate`, FasterTransformer). Dynamic waits to form a batch until it is full
or the oldest request has waited `batch_window_s`. Like those systems, a batch reserves a rectangular KV cache up
front: every row holds blocks for the batch's longest prompt + its largest max_tokens
(`llmso_lab.batching.static_batch`), so these modes never preempt; the token budget and chunked prefill are
iteration-level knobs and do not apply. n > 1 and beam search need continuous batching (a lock-step batch cannot
grow by forking), and so do the features in `engine.compat` that say so.
"""
from __future__ import annotations

from llmso_lab.batching import static_batch
from llmso_lab.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from llmso_lab.engine.sequence import Sequence, SequenceStatus


class LockstepScheduler(Scheduler):
    def retire(self) -> list[Sequence]:
        if not all(s.is_finished for s in self.running):
            return []   # a static batch keeps every slot until its longest row is done
        return super().retire()

    def _schedule(self, out: SchedulerOutput, now: float) -> None:
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


class LockstepBatching:
    """The engine feature: refuses what a lock-step batch cannot do (n > 1, beam search)."""
    name = "batching"

    def __init__(self, engine) -> None:
        pass

    def check_request(self, params) -> None:
        if params.n > 1:
            raise ValueError(f"n={params.n} needs batching='continuous' (a static batch cannot grow by forking)")

    def check_search(self) -> None:
        raise ValueError("beam_search needs batching='continuous' (beams fork and are pruned step by step)")

    def stats(self) -> dict:
        return {}
