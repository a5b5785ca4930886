"""Discrete-event simulator of a serving engine: batching modes, token budget, KV blocks, preemption.

Time advances one engine step at a time; each step's length comes from a cost model
(`StepCost` for a roofline of real hardware, `UnitCost` to count iterations). Between steps the
clock jumps to the next arrival when there is nothing to run.

  static      a batch of `max_num_seqs` requests (fewer only when no more will arrive) is padded to
              its longest prompt and run to its longest output; finished rows keep their slot and
              are still computed; every row's answer is returned when the batch ends. Each row reserves
              the KV of longest prompt + longest output up front (a rectangle, as Hugging Face does).
  dynamic     the same, but a batch also starts when `batch_window_s` has passed since its oldest
              request arrived.
  continuous  iteration-level: every step, decodes first, then prefill chunks in the leftover
              `max_num_batched_tokens` budget; finished sequences leave at once and waiting ones join.

A sequence's state is (tokens known = prompt + generated, tokens with KV = num_computed). A step
processes `n` of its uncomputed tokens; when none are left it samples one token. A decode is the
case n = 1; a recompute-preempted sequence re-prefills prompt + generated tokens.

It applies the engine's rules (`llmso_lab.engine.Scheduler`) through the same functions
(`llmso_lab.batching`, `llmso_lab.policies`), so that on the same workload it makes the engine's decisions
step for step (`tests/test_sim_engine_agreement.py`); what it adds is time, from the cost model. It has no
prefix cache and an unlimited swap pool.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from llmso_lab.batching import is_decode, prefill_chunk, static_batch
from llmso_lab.sim.cost import CostModel
from llmso_lab.policies import POLICIES, pick_victim, policy_key
from llmso_lab.sim.results import RequestMetrics, SimResult, SimStep
from llmso_lab.workloads import Request

__all__ = ["SimConfig", "simulate"]


@dataclass(slots=True)
class SimConfig:
    """Engine settings, named as in vLLM (and in `llmso_lab.engine.LLM`)."""

    batching: str = "continuous"              # "static" | "dynamic" | "continuous"
    max_num_seqs: int = 32                    # batch slots
    max_num_batched_tokens: int = 2048        # tokens per step (continuous only)
    enable_chunked_prefill: bool = True       # False: a prefill must fit the leftover budget whole
    block_size: int = 16                      # tokens per KV block
    num_kv_blocks: int | None = None          # None: what fits beside the weights (unbounded on a CPU)
    gpu_memory_utilization: float = 0.9       # share of device memory for weights + KV when sizing blocks
    scheduling_policy: str = "fcfs"           # "fcfs" | "priority" | "sjf"
    preemption_mode: str = "recompute"        # "recompute" | "swap"
    batch_window_s: float = 0.0               # dynamic: longest wait of a batch's oldest request (s)
    sjf_aging: float = 0.0                    # sjf: predicted tokens forgiven per second waited
    output_len_predictor: Callable[[Request], float] | None = None  # sjf; None: the true output_len

    def __post_init__(self) -> None:
        choices = {"batching": ("static", "dynamic", "continuous"), "scheduling_policy": POLICIES,
                   "preemption_mode": ("recompute", "swap")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; use one of {allowed}")
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.block_size) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be >= 1")


@dataclass(slots=True, eq=False)
class _Seq:
    req: Request
    index: int
    predicted_output_len: float  # sjf: predicted output length (the true one unless a predictor is given)
    num_generated: int = 0
    num_computed: int = 0        # tokens whose KV is in the cache (on the device or swapped out)
    blocks: int = 0              # KV blocks held (on the device, or on the host while swapped)
    slot: int = -1
    status: str = "waiting"      # waiting | running | swapped | finished
    first_token_time: float = math.nan
    finish_time: float = math.nan
    num_preemptions: int = 0

    arrival_time = property(lambda self: self.req.arrival_time)
    priority = property(lambda self: self.req.priority)
    predicted_len = property(lambda self: self.predicted_output_len - self.num_generated)   # still to generate

    @property
    def len(self) -> int:
        return self.req.prompt_len + self.num_generated

    @property
    def is_decode(self) -> bool:
        return is_decode(self.len, self.num_computed, self.num_generated)


def simulate(requests: Sequence[Request], cost: CostModel, config: SimConfig | None = None, **settings) -> SimResult:
    """Run `requests` through a simulated engine; `settings` override fields of `config`."""
    cfg = dataclasses.replace(config or SimConfig(), **settings)
    return _Simulator(requests, cost, cfg).run()


class _Simulator:
    def __init__(self, requests: Sequence[Request], cost: CostModel, cfg: SimConfig):
        self.cost, self.cfg, self.now = cost, cfg, 0.0
        predict = cfg.output_len_predictor or (lambda r: r.output_len)
        seqs = [_Seq(r, i, float(predict(r))) for i, r in enumerate(requests)]
        self.all = seqs
        self.pending = sorted(seqs, key=lambda s: (s.arrival_time, s.index), reverse=True)  # pop() = next
        self.waiting: list[_Seq] = []
        self.swapped: list[_Seq] = []
        self.running: list[_Seq] = []
        self.slots: list[_Seq | None] = [None] * cfg.max_num_seqs
        self.batch: list[_Seq] | None = None       # static / dynamic: the batch being run
        self.batch_iter = 0
        self.steps: list[SimStep] = []
        self.unrecorded_preempted: list[_Seq] = []   # preempted in a step that then ran nothing
        self.num_finished = 0
        if cfg.num_kv_blocks is not None:
            self.total_blocks: float = cfg.num_kv_blocks
        else:
            cap = cost.kv_capacity_tokens(cfg.gpu_memory_utilization)
            self.total_blocks = math.inf if cap is None else cap // cfg.block_size
        self.free_blocks = self.total_blocks
        self._validate()

    def _validate(self) -> None:
        cfg = self.cfg
        for s in self.all:
            need = self._blocks_for(s.req.prompt_len + s.req.output_len)
            if need > self.total_blocks:
                raise ValueError(f"request {s.req.request_id} needs {need} KV blocks but num_kv_blocks is "
                                 f"{self.total_blocks}: raise num_kv_blocks or shorten the request")
            if cfg.batching == "continuous" and not cfg.enable_chunked_prefill and \
                    s.req.prompt_len + s.req.output_len > cfg.max_num_batched_tokens:
                raise ValueError(f"request {s.req.request_id} may need a {s.req.prompt_len + s.req.output_len}-token "
                                 f"prefill but max_num_batched_tokens is {cfg.max_num_batched_tokens}: raise it or "
                                 "set enable_chunked_prefill=True")

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size)

    def _key(self, s: _Seq) -> tuple:
        return policy_key(s, self.cfg.scheduling_policy, self.now, self.cfg.sjf_aging)

    # ---- main loop --------------------------------------------------------------------------
    def run(self) -> SimResult:
        while self.num_finished < len(self.all):
            while self.pending and self.pending[-1].arrival_time <= self.now:
                self.waiting.append(self.pending.pop())
            stepped = self._continuous_step() if self.cfg.batching == "continuous" else self._batch_step()
            if not stepped:
                self.now = self._next_event()
        metrics = [RequestMetrics(s.req.request_id, s.arrival_time, s.first_token_time, s.finish_time,
                                  s.req.prompt_len, s.req.output_len, s.num_preemptions) for s in self.all]
        return SimResult(metrics, self.steps, sum(s.num_preemptions for s in self.all), self.cfg, self.total_blocks)

    def _next_event(self) -> float:
        t = self.pending[-1].arrival_time if self.pending else math.inf
        if self.cfg.batching == "dynamic" and self.waiting:
            t = min(t, min(s.arrival_time for s in self.waiting) + self.cfg.batch_window_s)
        if not self.now < t < math.inf:
            raise RuntimeError(f"simulator stalled at t={self.now:.6f}s with {len(self.waiting)} waiting")
        return t

    def _take_slot(self, seq: _Seq) -> None:
        seq.slot = self.slots.index(None)
        self.slots[seq.slot] = seq

    def _release(self, seq: _Seq) -> None:
        self.slots[seq.slot], seq.slot = None, -1
        self.running.remove(seq)

    def _record(self, start: float, prefill: list[tuple[int, int]], decode: list[int], kinds: dict[_Seq, str],
                work: dict[_Seq, int], preempted: Sequence[_Seq] = (), swapped_in: Sequence[_Seq] = ()) -> None:
        """prefill: (tokens incl. padding, context before) per prefilling row; decode: context per decoding row;
        work: real tokens computed per sequence."""
        slots = [(None, "free") if s is None else (s.req.request_id, kinds.get(s, "stalled")) for s in self.slots]
        used = sum(s.blocks for s in self.running)
        preempted, self.unrecorded_preempted = [*self.unrecorded_preempted, *preempted], []
        self.steps.append(SimStep(start, self.now - start, sum(n for n, _ in prefill), len(prefill), len(decode),
                                  sum(n + p for n, p in prefill) + sum(decode), used, slots,
                                  [s.req.request_id for s in preempted],
                                  {s.req.request_id: n for s, n in work.items() if kinds[s] == "prefill"},
                                  [s.req.request_id for s in swapped_in]))

    def _advance(self, seq: _Seq, n: int) -> None:
        """`seq` computed `n` more tokens in the step that just ended at `self.now`."""
        seq.num_computed += n
        if seq.num_computed == seq.len:          # every known token has KV: sample the next one
            seq.num_generated += 1
            if seq.num_generated == 1:
                seq.first_token_time = self.now

    def _finish(self, seq: _Seq) -> None:
        seq.status, seq.finish_time = "finished", self.now
        self.free_blocks += seq.blocks
        seq.blocks = 0
        self._release(seq)
        self.num_finished += 1

    # ---- continuous batching ----------------------------------------------------------------
    def _continuous_step(self) -> bool:
        """One step of `llmso_lab.engine.Scheduler._schedule_continuous`, on block counts."""
        cfg, budget = self.cfg, self.cfg.max_num_batched_tokens
        work: dict[_Seq, int] = {}               # tokens each sequence computes in this step
        preempted, swapped_in = [], []
        extra_s = 0.0                            # swap transfers stall the step
        # 1) running sequences: decodes first, then unfinished prefills, each in policy order
        for seq in sorted(self.running, key=lambda s: (not s.is_decode, self._key(s))):
            if seq.status != "running":
                continue                         # preempted as a victim earlier in this loop
            n = prefill_chunk(seq.len - seq.num_computed, budget, cfg.enable_chunked_prefill)
            if n == 0:
                continue
            need = self._blocks_for(seq.num_computed + n) - seq.blocks
            while need > self.free_blocks:       # preempt by policy until the blocks fit
                victim = pick_victim(self.running, cfg.scheduling_policy, self.now, cfg.sjf_aging)
                budget += work.pop(victim, 0)
                extra_s += self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status == "running":
                self.free_blocks -= need
                seq.blocks += need
                work[seq] = n
                budget -= n
        # 2) bring back swapped sequences, then admit waiting ones; neither in a step that had to preempt,
        # and no new request while a swapped one is still out
        for queue in (self.swapped, self.waiting):
            if preempted or (queue is self.waiting and self.swapped):
                break
            for seq in sorted(queue, key=self._key):
                n = prefill_chunk(seq.len - seq.num_computed, budget, cfg.enable_chunked_prefill)
                blocks = self._blocks_for(seq.num_computed + n)
                if len(self.running) == cfg.max_num_seqs or n == 0 or blocks > self.free_blocks:
                    break
                if seq.status == "swapped":
                    extra_s += self.cost.swap_time(seq.blocks * cfg.block_size)  # swap in
                    swapped_in.append(seq)
                queue.remove(seq)
                self.free_blocks -= blocks
                seq.blocks, seq.status = blocks, "running"
                self.running.append(seq)
                self._take_slot(seq)
                work[seq] = n
                budget -= n
        assert sum(work.values()) <= cfg.max_num_batched_tokens and len(self.running) <= cfg.max_num_seqs
        assert self.free_blocks >= 0
        if not work:
            self.now += extra_s
            self.unrecorded_preempted += preempted   # reported with the next recorded step
            return bool(preempted)
        # 3) one forward over the flattened batch
        kinds = {s: "decode" if s.is_decode else "prefill" for s in work}
        prefill = [(n, s.num_computed) for s, n in work.items() if kinds[s] == "prefill"]
        decode = [s.num_computed + 1 for s, n in work.items() if kinds[s] == "decode"]
        start = self.now
        self.now += self.cost.step_time(prefill, decode) + extra_s
        self._record(start, prefill, decode, kinds, work, preempted, swapped_in)
        # 4) append the sampled tokens, retire finished sequences
        for seq, n in work.items():
            self._advance(seq, n)
            if seq.num_generated == seq.req.output_len:
                self._finish(seq)
        return True

    def _preempt(self, seq: _Seq) -> float:
        """Evict `seq` from the device; returns the seconds its swap-out takes (0 for recompute)."""
        seq.num_preemptions += 1
        self._release(seq)
        self.free_blocks += seq.blocks
        if self.cfg.preemption_mode == "swap":   # the blocks with computed KV go to the host; num_computed is kept
            seq.status, seq.blocks = "swapped", self._blocks_for(seq.num_computed)
            self.swapped.append(seq)
            return self.cost.swap_time(seq.blocks * self.cfg.block_size)
        seq.status, seq.blocks, seq.num_computed = "waiting", 0, 0   # drop the KV; re-prefill later
        self.waiting.append(seq)
        return 0.0

    # ---- static and dynamic batching --------------------------------------------------------
    def _form_batch(self) -> bool:
        cfg = self.cfg
        if not self.waiting:
            return False
        full, last = len(self.waiting) >= cfg.max_num_seqs, not self.pending
        window_closed = cfg.batching == "dynamic" and \
            self.now >= min(s.arrival_time for s in self.waiting) + cfg.batch_window_s
        if not (full or last or window_closed):
            return False
        queue = sorted(self.waiting, key=self._key)
        rows, reserve = static_batch([(s.req.prompt_len, s.req.output_len) for s in queue], cfg.max_num_seqs,
                                     self.free_blocks, cfg.block_size)
        assert rows, "a single request fits the KV cache (checked up front)"
        batch = queue[:rows]
        for seq in batch:   # every row reserves the rectangle: longest prompt + longest output
            self.waiting.remove(seq)
            seq.status, seq.blocks = "running", self._blocks_for(reserve)
            self.free_blocks -= seq.blocks
            self.running.append(seq)
            self._take_slot(seq)
        self.batch, self.batch_iter = batch, 0
        return True

    def _batch_step(self) -> bool:
        if self.batch is None and not self._form_batch():
            return False
        batch, i = self.batch, self.batch_iter
        p_max = max(s.req.prompt_len for s in batch)
        # padded shapes: every row is computed, whether or not it is still generating
        prefill, decode = ([(p_max, 0)] * len(batch), []) if i == 0 else ([], [p_max + i] * len(batch))
        active = [s for s in batch if s.num_generated < s.req.output_len]
        kinds = {s: ("prefill" if i == 0 else "decode") if s in active else "idle" for s in batch}
        start = self.now
        self.now += self.cost.step_time(prefill, decode)
        self._record(start, prefill, decode, kinds, {s: s.req.prompt_len if i == 0 else 1 for s in active})
        for s in active:
            s.num_generated += 1
            if s.num_generated == 1:
                s.first_token_time = self.now
        self.batch_iter += 1
        if self.batch_iter == max(s.req.output_len for s in batch):   # the whole batch returns together
            for s in batch:
                self._finish(s)
            self.batch = None
        return True
