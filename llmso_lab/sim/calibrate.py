"""A CPU cost profile and its calibration on measured engine steps.

On a CPU the same cores do the math and stream the weights, so the profile adds compute and memory
time instead of taking the max:  t = overhead + FLOPs / (eta_c * peak) + bytes / (eta_m * bandwidth).
That is linear in (overhead, 1/(eta_c * peak), 1/(eta_m * bandwidth)), so fitting it to measured
steps is a non-negative least-squares problem with three unknowns.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from llmso_lab.hardware import Accelerator, measure_cpu
from llmso_lab.models.shapes import SMOLLM2_135M, ModelShape
from llmso_lab.sim.cost import StepCost
from llmso_lab.workloads import latency_summary

__all__ = ["cpu_profile", "calibrate", "relative_errors", "as_record", "EngineStepRecord", "records_from_engine_traces",
           "StepDecisions", "decisions_from_engine_traces", "decisions_from_sim", "EngineRun", "run_on_engine"]

Record = tuple[int, int, int, float]  # (num_prefill_tokens, num_decode_seqs, sum_context_len, seconds)


def cpu_profile(model: ModelShape = SMOLLM2_135M, hardware: Accelerator | None = None, dtype_bytes: float = 4,
                compute_efficiency: float = 1.0, bandwidth_efficiency: float = 1.0, overhead_s: float = 0.0) -> StepCost:
    """An uncalibrated cost model of this CPU (measured with `measure_cpu()` when `hardware` is None)."""
    return StepCost(hardware or measure_cpu(), model, dtype_bytes, None, compute_efficiency,
                    bandwidth_efficiency, overhead_s, overlap=False)


def as_record(r: Any) -> tuple[int, int, int, float, int | None]:
    """A 4-tuple, or an object with num_prefill_tokens, num_decode_seqs, sum_context_len, seconds
    (and optionally num_prefill_seqs) -> (prefill tokens, decode seqs, sum context, seconds, prefill seqs)."""
    if hasattr(r, "num_prefill_tokens"):
        return (int(r.num_prefill_tokens), int(r.num_decode_seqs), int(r.sum_context_len), float(r.seconds),
                getattr(r, "num_prefill_seqs", None))
    r = tuple(r)
    assert len(r) == 4, f"a record is (num_prefill_tokens, num_decode_seqs, sum_context_len, seconds), got {r!r}"
    return int(r[0]), int(r[1]), int(r[2]), float(r[3]), None


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0, by trying every set of free columns (fine for 3 unknowns)."""
    best, best_res = np.zeros(a.shape[1]), float(np.sum(b**2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x_sub = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if np.all(x_sub >= 0):
                x = np.zeros(a.shape[1])
                x[list(cols)] = x_sub
                res = float(np.sum((a @ x - b) ** 2))
                if res < best_res:
                    best, best_res = x, res
    return best


def calibrate(records: Iterable[Any], model: ModelShape = SMOLLM2_135M, hardware: Accelerator | None = None,
              dtype_bytes: float = 4, relative: bool = True) -> StepCost:
    """Fit a CPU profile's overhead and compute/bandwidth efficiencies to measured steps.

    records: (num_prefill_tokens, num_decode_seqs, sum_context_len, seconds) per engine step
             (see `StepCost.count_work` for what the context sum counts).
    relative: weight each step by 1/seconds, so short decode steps count as much as long prefills.
    The weight read and `overhead_s` are both paid once per step, so the data pins down their sum
    tightly; telling them apart rests on how much the KV traffic varies between steps.
    """
    base = cpu_profile(model, hardware, dtype_bytes)
    rows = [as_record(r) for r in records]
    assert len(rows) >= 3, f"need at least 3 step records to fit 3 parameters, got {len(rows)}"
    work = np.array([base.count_work(p, d, c, ps) for p, d, c, _, ps in rows])  # [N, 2] flops, bytes
    t = np.array([r[3] for r in rows])
    a = np.column_stack([np.ones(len(t)), work])                                 # [N, 3]
    w = 1.0 / t if relative else np.ones_like(t)
    scale = np.abs(a * w[:, None]).max(axis=0)  # column scaling keeps lstsq well conditioned
    scale[scale == 0] = 1.0
    x = _nnls(a * w[:, None] / scale, t * w) / scale
    overhead, s_per_flop, s_per_byte = x.tolist()
    hw = base.hardware
    base.overhead_s = overhead
    base.compute_efficiency = 1 / (s_per_flop * hw.peak_flops) if s_per_flop > 0 else math.inf
    base.bandwidth_efficiency = 1 / (s_per_byte * hw.mem_bandwidth) if s_per_byte > 0 else math.inf
    return base


def relative_errors(cost: StepCost, records: Iterable[Any]) -> np.ndarray:
    """(predicted - measured) / measured for each record."""
    rows = [as_record(r) for r in records]
    pred = np.array([cost.time_of(*cost.count_work(p, d, c, ps)) for p, d, c, _, ps in rows])
    meas = np.array([r[3] for r in rows])
    return (pred - meas) / meas


@dataclass(frozen=True, slots=True)
class EngineStepRecord:
    """One measured engine step in the form `calibrate` fits (`as_record` reads these fields)."""

    step: int
    num_prefill_tokens: int    # prompt tokens computed (static batching: padding included)
    num_prefill_seqs: int
    num_decode_seqs: int       # one-token rows (static batching: idle rows included)
    sum_context_len: int       # KV tokens attended, summed over the step's sequences
    seconds: float             # the step's wall time (scheduling, forward, sampling)


def records_from_engine_traces(traces: Iterable[Any], num_cached_tokens: Mapping[str, int] | None = None,
                               skip_first: int = 0) -> list[EngineStepRecord]:
    """Turn `LLM.step()` trace records (in step order, one engine run) into calibration records.

    A trace says who prefilled how many tokens and who decoded, not how long each context was, so this
    replays the steps and tracks every request's computed tokens: a prefill chunk of n tokens attends to
    the tokens already computed plus its own n, a decode to everything computed plus itself. A request
    preempted by recompute starts again from 0; one that comes back through `swapped_in` keeps its KV.
    num_cached_tokens: prefix-cache hits per request id (`RequestOutput.num_cached_tokens`), when the
        engine ran with prefix caching; their tokens count as already computed.
    skip_first: drop the first steps (warm-up: the first forward pays one-off allocation costs).
    Steps that computed nothing are dropped.
    """
    cached = dict(num_cached_tokens or {})
    computed: dict[str, int] = {}
    preempted: set[str] = set()
    records = []
    for i, tr in enumerate(traces):
        swapped_in = set(tr.swapped_in)
        for rid in list(tr.prefill) + list(tr.decode):
            if rid in preempted:
                preempted.discard(rid)
                if rid not in swapped_in:            # recompute: the KV was dropped
                    computed[rid] = 0
        ctx, pre_tokens = 0, 0
        for rid, n in tr.prefill.items():
            start = computed.get(rid, cached.get(rid, 0))
            pre_tokens += tr.num_tokens.get(rid, n)
            ctx += start + n
            computed[rid] = start + n
        for rid in tr.decode:
            ctx += computed.get(rid, 0) + 1
            computed[rid] = computed.get(rid, 0) + 1
        for rid in tr.idle:
            ctx += computed.get(rid, 0)
        preempted.update(tr.preempted)
        if (tr.prefill or tr.decode or tr.idle) and i >= skip_first:
            records.append(EngineStepRecord(tr.step, pre_tokens, len(tr.prefill), len(tr.decode) + len(tr.idle), ctx,
                                            float(tr.wall_time_s)))
    return records


@dataclass(frozen=True, slots=True)
class StepDecisions:
    """What the scheduler decided in one step that ran a forward, in terms an engine trace (`StepTrace`) and a
    simulated step (`SimStep`) share. Request ids as strings."""

    prefill: dict[str, int]        # request -> prompt tokens computed (padding excluded)
    decode: frozenset[str]         # requests that computed their last sampled token
    idle: frozenset[str]           # static batching: finished rows still computed
    preempted: tuple[str, ...]     # in preemption order (including those of steps in between that ran nothing)
    swapped_in: frozenset[str]


def decisions_from_engine_traces(traces: Iterable[Any]) -> list[StepDecisions]:
    """`LLM.step()` traces -> one `StepDecisions` per step that ran a forward."""
    out, preempted = [], []
    for tr in traces:
        preempted += tr.preempted
        if tr.num_tokens:
            out.append(StepDecisions({str(r): n for r, n in tr.prefill.items()}, frozenset(map(str, tr.decode)),
                                     frozenset(map(str, tr.idle)), tuple(map(str, preempted)),
                                     frozenset(map(str, tr.swapped_in))))
            preempted = []
    return out


def decisions_from_sim(result: Any) -> list[StepDecisions]:
    """A `SimResult`'s steps -> one `StepDecisions` each (compare with `decisions_from_engine_traces`)."""
    def kind(step, k):
        return frozenset(str(r) for r, slot_kind in step.slots if slot_kind == k)

    return [StepDecisions({str(r): n for r, n in st.prefill.items()}, kind(st, "decode"), kind(st, "idle"),
                          tuple(map(str, st.preempted)), frozenset(map(str, st.swapped_in))) for st in result.steps]


@dataclass(slots=True)
class EngineRun:
    """What `run_on_engine` measured."""

    outputs: list[Any]         # RequestOutput per request, in workload order
    traces: list[Any]          # StepTrace per step
    wall_s: float              # first step to last step
    num_output_tokens: int

    @property
    def output_throughput(self) -> float:
        """Generated tokens per second of wall time (compare with `SimResult.output_throughput`)."""
        return self.num_output_tokens / self.wall_s

    def summary(self) -> dict[str, Any]:
        """The keys of `SimResult.summary` that a real run has: throughput, TTFT/TPOT/E2E percentiles (s),
        preemptions — so a simulation and an engine run of one workload print side by side."""
        metrics = [o.metrics for o in self.outputs]
        return {"num_requests": len(metrics), "duration_s": self.wall_s,
                "output_tokens_per_s": self.output_throughput, **latency_summary(metrics),
                "num_preemptions_total": sum(m.num_preemptions for m in metrics), "num_steps": len(self.traces)}


def run_on_engine(llm: Any, requests: Iterable[Any], seed: int = 0, replay_arrivals: bool = False,
                  prompts: list[list[int]] | None = None, desc: str | None = None) -> EngineRun:
    """Run a workload (`llmso_lab.workloads.Request`s) through an engine `LLM`: exactly output_len tokens
    each (EOS ignored), on `prompts` (token ids, one list per request) or else on seeded random ids of each
    prompt_len. With `replay_arrivals` the requests arrive at their arrival times on the engine clock;
    otherwise all at once (an offline batch). `desc`: show a progress bar over finished requests."""
    import time

    from tqdm.auto import tqdm

    from llmso_lab.engine import SamplingParams   # the simulator itself does not need the engine

    reqs = list(requests)
    if prompts is None:
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(16, llm.model_runner.vocab_size, size=r.prompt_len).tolist() for r in reqs]
    t0 = llm.clock()
    ids = []
    for r, prompt in zip(reqs, prompts, strict=True):
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        ids.append(llm.add_request({"prompt_token_ids": prompt}, params, priority=r.priority,
                                   arrival_time=t0 + r.arrival_time if replay_arrivals else None))
    done, traces = {}, []
    with tqdm(total=len(reqs), desc=desc, disable=desc is None) as bar:
        while llm.has_unfinished_requests():
            finished, trace = llm.step()
            traces.append(trace)
            if not trace.num_batched_tokens and not finished:
                time.sleep(0.001)                         # waiting for the next arrival
            done.update({o.request_id: o for o in finished})
            if finished:
                bar.update(len(finished))
    wall = llm.clock() - t0
    outs = [done[i] for i in ids]
    return EngineRun(outs, traces, wall, sum(len(o.outputs[0].token_ids) for o in outs))
