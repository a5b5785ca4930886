"""Planning prefill-decode disaggregation at scale (lecture 2-3): how many prefill and decode instances.

`best_pd_ratio` is the capacity argument in one line: a prefill instance finishes `prefill_tokens_per_s /
input_len` prompts per second, a decode instance `decode_tokens_per_s / output_len` answers per second; x prefill
and y decode instances serve min(x * the first, y * the second) requests per second.

`simulate_pd` checks that argument with queues and time (a discrete-event model of xP:yD pools):

  prefill pool  each instance batches prompts continuously (FCFS, chunked, `max_num_batched_tokens` a step); a
                request goes to the instance with the fewest queued prompt tokens. It frees the prompt's KV when
                the prompt is done (the transfer reads a send buffer).
  transfer      the KV (2 x layers x kv_heads x head_dim x dtype bytes per token: the model shape) goes to the
                decode instance with the fewest requests, over `link`. A TP group sends its shards in parallel,
                one stream per rank pair (min of the two TP sizes). Layer by layer, layer i's KV travels while
                later layers compute (`disagg.transfer.exposed_transfer_time`, with the prefill's time, first
                chunk to last, spread evenly over the layers); whole, it leaves after the last layer. One
                instance's transfers share its NICs in FIFO order; the receiving side is not a bottleneck.
  decode pool   each instance decodes its batch continuously (up to `max_num_seqs`, KV reserved for prompt +
                output at admission, FCFS); a request whose KV has landed waits until it fits.

Prefill instances are `cluster`'s replica model (one engine model for the simulator's clusters); decode instances
make the same decisions from running totals (`_Decoder`: a step costs O(1) to simulate, which long answers need);
`simulate_colocated` is `cluster.simulate_cluster` itself. An instance may be a TP group (`comm.TPCost`). The first
token reaches the user with the KV on the decode side, so TTFT = queue + prefill + exposed transfer, and a wait
for a decode slot shows up in TPOT (the decode pool's congestion). Times in seconds, sizes in tokens.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from llmso_lab.disagg.transfer import exposed_transfer_time
from llmso_lab.hardware import LINKS, Link
from llmso_lab.routing import LeastLoaded
from llmso_lab.sim.cluster import ClusterConfig, _Replica, _Req, simulate_cluster
from llmso_lab.sim.comm import TPCost
from llmso_lab.sim.cost import CostModel
from llmso_lab.workloads import Request, RequestMetrics, SharedPrefixRequest, percentiles, poisson_arrivals

__all__ = ["best_pd_ratio", "pd_capacity", "TPCost", "PDResult", "Autoscaler", "fixed_workload", "simulate_pd",
           "simulate_colocated"]

_UNBOUNDED = 1 << 60   # KV capacity of a device with no memory figure (a CPU)


def pd_capacity(num_prefill: int, num_decode: int, input_len: int, output_len: int,
                prefill_tokens_per_s: float, decode_tokens_per_s: float) -> float:
    """Requests per second that `num_prefill` prefill and `num_decode` decode instances sustain (the slower pool)."""
    if min(input_len, output_len) <= 0 or min(prefill_tokens_per_s, decode_tokens_per_s) <= 0:
        raise ValueError("lengths and rates must be > 0")
    return min(num_prefill * prefill_tokens_per_s / input_len, num_decode * decode_tokens_per_s / output_len)


def best_pd_ratio(total_instances: int, input_len: int, output_len: int, prefill_tokens_per_s: float,
                  decode_tokens_per_s: float) -> tuple[int, int]:
    """(x, y) with x + y = total_instances, x >= 1, y >= 1, maximising `pd_capacity`; on a tie, fewer prefill
    instances. Lecture: input 4000 / output 100 wants thick prefill, input 200 / output 2000 thick decode."""
    if not isinstance(total_instances, int) or total_instances < 2:
        raise ValueError(f"total_instances must be an int >= 2 (one per pool at least), got {total_instances!r}")
    return max(((x, total_instances - x) for x in range(1, total_instances)),
               key=lambda xy: (pd_capacity(*xy, input_len, output_len, prefill_tokens_per_s, decode_tokens_per_s), -xy[0]))


# ---- results -----------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class PDResult:
    """What `simulate_pd` / `simulate_colocated` return. `phases` (PD only): per request, in workload order,
    "queue_s" (arrival -> first prefill step), "prefill_s", "transfer_s" (exposed, NIC queueing included; their
    sum is the TTFT) and "decode_wait_s" (KV landed -> first decode step). `timeline`: after each event but decode
    steps (arrivals, prefill steps, transfers, switches, autoscaler ticks), "t",
    "prefill_queue" / "decode_queue" (requests waiting; decode: KV landed or in flight), "prefill_running",
    "decode_running", "num_prefill", "num_decode" (instances). `scaling`: the autoscaler's decisions."""

    requests: list[RequestMetrics]
    ttft_slo_s: float
    tpot_slo_s: float
    busy_s: dict[str, float]                 # per pool: instance-seconds spent in steps
    instance_s: dict[str, float]             # per pool: instance-seconds it had
    phases: dict[str, list[float]] | None = None
    timeline: dict[str, list[float]] = field(default_factory=dict)
    scaling: list[dict[str, Any]] = field(default_factory=list)

    def meets_slo(self) -> list[bool]:
        return [m.ttft <= self.ttft_slo_s and m.tpot <= self.tpot_slo_s for m in self.requests]

    @property
    def goodput(self) -> float:
        """Requests per second meeting both SLOs, over the window the requests arrived in (the offered rate times
        the SLO attainment); an offline batch (one arrival time) counts first arrival -> last finish."""
        arrivals = [m.arrival_time for m in self.requests]
        window = max(arrivals) - min(arrivals) or max(m.finish_time for m in self.requests) - min(arrivals)
        return sum(self.meets_slo()) / window

    def summary(self) -> dict[str, Any]:
        """Goodput (req/s), SLO attainment, output tokens/s (first arrival -> last finish), TTFT and TPOT p50/p99
        (s), utilisation per pool, and (PD) the mean TTFT split."""
        r = self.requests
        duration = max(m.finish_time for m in r) - min(m.arrival_time for m in r)
        ttft, tpot = percentiles([m.ttft for m in r], (50, 99)), percentiles([m.tpot for m in r if m.output_len > 1], (50, 99))
        out = {"goodput": self.goodput, "slo_attainment": float(np.mean(self.meets_slo())),
               "output_tokens_per_s": sum(m.output_len for m in r) / duration,
               "ttft_p50": ttft["p50"], "ttft_p99": ttft["p99"], "tpot_p50": tpot["p50"], "tpot_p99": tpot["p99"]}
        out.update({f"util_{pool}": self.busy_s[pool] / self.instance_s[pool] if self.instance_s[pool] else math.nan
                    for pool in self.busy_s})
        if self.phases:
            out.update({f"mean_{k}": float(np.mean(v)) for k, v in self.phases.items()})
        return out


def fixed_workload(n: int, rate: float, input_len: int, output_len: int, seed: int = 0, start: float = 0.0,
                   first_id: int = 0) -> list[Request]:
    """`n` requests of the lecture's fixed shape (`input_len` prompt, `output_len` output tokens), Poisson arrivals
    at `rate` requests/s from `start`; ids from `first_id` (concatenate phases for a mix that changes in time)."""
    return [Request(first_id + i, t, input_len, output_len) for i, t in enumerate(poisson_arrivals(rate, n, seed, start))]


@dataclass(frozen=True, slots=True)
class Autoscaler:
    """Queue-driven rebalancing of a PD cluster (lecture: watch both pools' queues; prefill queue wait shows up in
    TTFT, decode batch occupancy in TPOT). Every `interval_s`, with no instance in transit:

      prefill pressure = mean queue wait (requests that started prefill in the interval, and those still
                         waiting, so far) / TTFT SLO
      decode pressure  = what the decode pool's requests (running, waiting, in flight) need / what it holds:
                         the larger of batch slots and KV tokens

    If one exceeds the other by `min_gap`, the least-loaded instance of the other pool (never its last) stops
    taking requests, finishes what it holds, waits `switch_delay_s` (reconfiguring) and joins the busier pool."""

    interval_s: float = 5.0
    switch_delay_s: float = 5.0
    min_gap: float = 0.25

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and self.switch_delay_s >= 0 and self.min_gap >= 0):
            raise ValueError("need interval_s > 0, switch_delay_s >= 0 and min_gap >= 0")


# ---- the event model -------------------------------------------------------------------------------------------
@dataclass(slots=True, eq=False)
class _State:
    req: Request
    prefill_start: float = math.nan
    prefill_end: float = math.nan
    first_token: float = math.nan
    decode_start: float = math.nan
    finish: float = math.nan


def _decode_time(cost: Any, num_seqs: int, sum_context: int) -> float:
    """One decode step of `num_seqs` sequences whose contexts sum to `sum_context`. The cost models here depend on
    the contexts only through their count and sum, so any list with both will do."""
    if hasattr(cost, "decode_time"):
        return cost.decode_time(num_seqs, sum_context)
    base, extra = divmod(sum_context, num_seqs)
    return cost.step_time((), [base + 1] * extra + [base] * (num_seqs - extra))


@dataclass(slots=True, eq=False)
class _Decoder:
    """A decode instance: every step each running request generates one token; waiting ones (KV landed) join at a
    step's start, first come first served, while a slot and KV room for prompt + output are free. It keeps totals
    (batch size, summed context) and a heap of the steps requests finish at, so a step costs the same to simulate
    whatever the batch size: the same decisions and times as `cluster`'s replica with decodes only."""

    cfg: ClusterConfig
    cost: Any
    waiting: deque = field(default_factory=deque)
    finishing: list = field(default_factory=list)   # heap of (step count it finishes at, order, state)
    steps: int = 0
    num_running: int = 0
    sum_context: int = 0                            # KV tokens the next step attends to, over the batch
    used: int = 0                                   # KV tokens reserved
    step_end: float | None = None
    busy_s: float = 0.0
    order: int = 0

    def start_step(self, now: float) -> list[_State]:
        """Admit what fits and start a step at `now` (idle if nothing runs); returns the admitted requests."""
        admitted = []
        while self.waiting and self.num_running < self.cfg.max_num_seqs:
            st = self.waiting[0]
            need = st.req.prompt_len + st.req.output_len
            if self.used + need > self.cfg.kv_capacity_tokens:
                break
            self.waiting.popleft()
            self.used, self.num_running, self.order = self.used + need, self.num_running + 1, self.order + 1
            self.sum_context += st.req.prompt_len + 1        # its first step attends to the prompt and token 1
            heapq.heappush(self.finishing, (self.steps + st.req.output_len - 1, self.order, st))
            admitted.append(st)
        self.step_end = None
        if self.num_running:
            dt = _decode_time(self.cost, self.num_running, self.sum_context)
            self.step_end, self.busy_s = now + dt, self.busy_s + dt
        return admitted

    def end_step(self) -> list[_State]:
        """Apply the step that ends now; returns the requests that generated their last token."""
        self.steps += 1
        self.sum_context += self.num_running                 # every context grew by one token
        done = []
        while self.finishing and self.finishing[0][0] == self.steps:
            st = heapq.heappop(self.finishing)[2]
            need = st.req.prompt_len + st.req.output_len     # also its context, had it gone on
            self.num_running, self.used, self.sum_context = self.num_running - 1, self.used - need, self.sum_context - need
            done.append(st)
        return done


@dataclass(slots=True, eq=False)
class _Instance:
    rep: Any                         # prefill: `cluster`'s replica model; decode: `_Decoder`
    role: str                        # "prefill" | "decode" | "switching"
    target: str | None = None        # autoscaling: the pool it joins once drained
    switch_at: float = math.inf      # when it joins `target`
    link_free: float = 0.0           # prefill: when its NICs finish the transfers queued on them
    inbound: list = field(default_factory=list)   # decode: requests whose KV is on its way here

    @property
    def load(self) -> int:
        """Requests it holds: prefill queued prompt tokens; decode requests running, waiting or inbound."""
        if self.role == "prefill":
            return sum(r.req.prompt_len - r.computed for r in (*self.rep.waiting, *self.rep.running))
        return self.rep.num_running + len(self.rep.waiting) + len(self.inbound)

    @property
    def idle(self) -> bool:
        running = self.rep.running if self.role == "prefill" else self.rep.num_running
        return not (self.rep.waiting or running or self.inbound)


def _wrap(req: Request, output_len: int) -> SharedPrefixRequest:
    return SharedPrefixRequest(req.request_id, req.arrival_time, req.prompt_len, output_len)   # no shared prefix


def _tp(cost: Any) -> int:
    return getattr(cost, "tp", 1)


def _pool_config(cost: CostModel, max_num_seqs: int, max_num_batched_tokens: int, kv_capacity_tokens: int | None,
                 gpu_memory_utilization: float, num_instances: int = 1) -> ClusterConfig:
    kv = kv_capacity_tokens if kv_capacity_tokens is not None else cost.kv_capacity_tokens(gpu_memory_utilization)
    return ClusterConfig(num_instances, max_num_seqs, max_num_batched_tokens, int(kv or _UNBOUNDED))


class _PDSim:
    def __init__(self, requests, num_prefill, num_decode, cost_prefill, cost_decode, link, layerwise, cfg_p, cfg_d,
                 autoscaler, kv_bytes_per_token, num_layers, ttft_slo_s, tpot_slo_s):
        self.costs, self.cfgs = {"prefill": cost_prefill, "decode": cost_decode}, {"prefill": cfg_p, "decode": cfg_d}
        self.link, self.layerwise, self.auto = link, layerwise, autoscaler
        self.kv_bytes, self.layers, self.streams = kv_bytes_per_token, num_layers, min(_tp(cost_prefill), _tp(cost_decode))
        self.slo = (ttft_slo_s, tpot_slo_s)
        self.states = [_State(r) for r in requests]
        self.owner: dict[_Req, _State] = {}                        # prefill replica's request -> its state
        self.reps: list[tuple[str, Any]] = []                       # every instance model made, for the busy time
        self.insts = [_Instance(self._new_rep("prefill"), "prefill") for _ in range(num_prefill)] + \
                     [_Instance(self._new_rep("decode"), "decode") for _ in range(num_decode)]
        self.transfers: list = []                                   # heap of (ready time, order, state, instance)
        self.order, self.now = 0, 0.0
        self.started: deque = deque()                               # (time, queue wait) of recent prefill starts
        self.timeline: dict[str, list[float]] = {k: [] for k in ("t", "prefill_queue", "decode_queue", "prefill_running",
                                                                   "decode_running", "num_prefill", "num_decode")}
        self.scaling: list[dict[str, Any]] = []

    def _new_rep(self, role: str) -> Any:
        rep = (_Replica if role == "prefill" else _Decoder)(self.cfgs[role], self.costs[role])
        self.reps.append((role, rep))
        return rep

    def _pool(self, role: str, active: bool = True) -> list[_Instance]:
        return [i for i in self.insts if i.role == role and not (active and i.target)]

    def run(self) -> PDResult:
        todo = sorted(self.states, key=lambda s: s.req.arrival_time)
        k, tick = 0, self.auto.interval_s if self.auto else math.inf
        while k < len(todo) or self.transfers or any(i.rep.step_end is not None or i.role == "switching" for i in self.insts):
            busy = [i for i in self.insts if i.rep.step_end is not None]
            t_step = min((i.rep.step_end for i in busy), default=math.inf)
            t_xfer = self.transfers[0][0] if self.transfers else math.inf
            t_switch = min(i.switch_at for i in self.insts)
            t_arrival = todo[k].req.arrival_time if k < len(todo) else math.inf
            self.now = min(t_step, t_xfer, t_switch, t_arrival, tick)
            if t_step == self.now:
                inst = min(busy, key=lambda i: i.rep.step_end)
                self._step_done(inst)
                if inst.role == "decode":
                    continue                      # not sampled: decode steps are most of the events
            elif t_xfer == self.now:
                self._landed(*heapq.heappop(self.transfers)[2:])
            elif t_switch == self.now:
                inst = min(self.insts, key=lambda i: i.switch_at)
                inst.role, inst.target, inst.switch_at = inst.target, None, math.inf
                inst.rep = self._new_rep(inst.role)
            elif t_arrival == self.now:
                self._arrive(todo[k])
                k += 1
            else:
                self._autoscale()
                tick += self.auto.interval_s
            self._sample()
        if any(math.isnan(s.finish) for s in self.states):
            raise RuntimeError("the PD simulation stalled with requests unfinished; this is a bug, please report it")
        return self._result()

    # ---- events --------------------------------------------------------------------------------------------------
    def _arrive(self, st: _State) -> None:
        inst = min(self._pool("prefill"), key=lambda i: i.load)     # fewest queued prompt tokens
        r = _Req(_wrap(st.req, 1), self.insts.index(inst))          # prefill only: done when its prompt is
        self.owner[r] = st
        inst.rep.waiting.append(r)
        if inst.rep.step_end is None:
            self._start(inst)

    def _start(self, inst: _Instance) -> None:
        if inst.role == "decode":
            for st in inst.rep.start_step(self.now):
                st.decode_start = self.now
        else:
            inst.rep.start_step(self.now)
            for r, _ in inst.rep.work:
                st = self.owner[r]
                if math.isnan(st.prefill_start):
                    st.prefill_start = self.now
                    self.started.append((self.now, self.now - st.req.arrival_time))
        if inst.target and inst.idle and inst.role != "switching":
            inst.role, inst.switch_at = "switching", max(self.now, inst.link_free) + self.auto.switch_delay_s

    def _step_done(self, inst: _Instance) -> None:
        if inst.role == "decode":
            for st in inst.rep.end_step():
                st.finish = self.now
        for r in inst.rep.end_step() if inst.role == "prefill" else ():
            st = self.owner.pop(r)
            st.prefill_end = self.now
            if st.req.output_len == 1:                      # the prefill's token is the whole answer
                st.first_token = st.finish = self.now
            else:
                self._send(inst, st)
        self._start(inst)

    def _send(self, src: _Instance, st: _State) -> None:
        """Queue the KV transfer of a prefilled request to the least-loaded decode instance."""
        dst = min(self._pool("decode"), key=lambda i: i.load)
        nbytes, bw = st.req.prompt_len * self.kv_bytes, self.link.bandwidth * self.streams
        if self.layerwise:
            per_layer = self.link.latency + nbytes / self.layers / bw
            compute, sends = [(self.now - st.prefill_start) / self.layers] * self.layers, [per_layer] * self.layers
        else:
            compute, sends = [self.now - st.prefill_start], [self.link.latency + nbytes / bw]
        exposed = exposed_transfer_time(compute, sends, self.layerwise)
        ready = max(self.now + exposed, src.link_free + sum(sends))   # behind the transfers already on its NICs
        src.link_free = ready
        dst.inbound.append(st)
        self.order += 1
        heapq.heappush(self.transfers, (ready, self.order, st, dst))

    def _landed(self, st: _State, dst: _Instance) -> None:
        st.first_token = self.now
        dst.inbound.remove(st)
        dst.rep.waiting.append(st)
        if dst.rep.step_end is None:
            self._start(dst)

    # ---- autoscaling ---------------------------------------------------------------------------------------------
    def _pressures(self) -> tuple[float, float]:
        """(prefill, decode) pressure as `Autoscaler` defines them."""
        while self.started and self.started[0][0] <= self.now - self.auto.interval_s:
            self.started.popleft()
        waits = [w for _, w in self.started] + [self.now - r.req.arrival_time
                                                  for i in self._pool("prefill", False) for r in i.rep.waiting]
        prefill = (float(np.mean(waits)) if waits else 0.0) / self.slo[0]
        dec, cfg = self._pool("decode"), self.cfgs["decode"]
        tokens = sum(i.rep.used + sum(s.req.prompt_len + s.req.output_len for s in (*i.rep.waiting, *i.inbound))
                     for i in dec)
        return prefill, max(sum(i.load for i in dec) / (len(dec) * cfg.max_num_seqs),
                            tokens / (len(dec) * cfg.kv_capacity_tokens))

    def _autoscale(self) -> None:
        p, d = self._pressures()
        move = None
        if not any(i.target or i.role == "switching" for i in self.insts):
            if p > d + self.auto.min_gap and len(self._pool("decode")) > 1:
                move = ("decode", "prefill")
            elif d > p + self.auto.min_gap and len(self._pool("prefill")) > 1:
                move = ("prefill", "decode")
        if move:
            donor = min(self._pool(move[0]), key=lambda i: i.load)
            donor.target = move[1]
            if donor.rep.step_end is None:
                self._start(donor)   # idle: it starts switching at once
        self.scaling.append({"t": self.now, "prefill_pressure": p, "decode_pressure": d,
                             "num_prefill": len(self._pool("prefill", False)), "num_decode": len(self._pool("decode", False)),
                             "move": f"{move[0]} -> {move[1]}" if move else ""})

    # ---- bookkeeping ---------------------------------------------------------------------------------------------
    def _sample(self) -> None:
        tl, pre, dec = self.timeline, self._pool("prefill", False), self._pool("decode", False)
        if tl["t"] and tl["t"][-1] == self.now:
            for v in tl.values():
                v.pop()
        for key, value in (("t", self.now), ("prefill_queue", sum(len(i.rep.waiting) for i in pre)),
                           ("decode_queue", sum(len(i.rep.waiting) + len(i.inbound) for i in dec)),
                           ("prefill_running", sum(len(i.rep.running) for i in pre)),
                           ("decode_running", sum(i.rep.num_running for i in dec)),
                           ("num_prefill", len(pre)), ("num_decode", len(dec))):
            tl[key].append(value)

    def _result(self) -> PDResult:
        metrics = [RequestMetrics(s.req.request_id, s.req.arrival_time, s.first_token, s.finish, s.req.prompt_len,
                                  s.req.output_len, first_scheduled_time=s.prefill_start) for s in self.states]
        phases = {"queue_s": [s.prefill_start - s.req.arrival_time for s in self.states],
                  "prefill_s": [s.prefill_end - s.prefill_start for s in self.states],
                  "transfer_s": [s.first_token - s.prefill_end for s in self.states],
                  "decode_wait_s": [s.decode_start - s.first_token if s.req.output_len > 1 else 0.0 for s in self.states]}
        t = np.array(self.timeline["t"])
        dt = np.diff(t, append=max(s.finish for s in self.states))    # each sample holds until the next
        instance_s = {p: float(np.dot(dt, self.timeline[f"num_{p}"])) for p in ("prefill", "decode")}
        busy = {p: sum(rep.busy_s for role, rep in self.reps if role == p) for p in ("prefill", "decode")}
        return PDResult(metrics, *self.slo, busy, instance_s, phases, self.timeline, self.scaling)


def simulate_pd(requests: Sequence[Request], num_prefill: int, num_decode: int, cost_prefill: CostModel,
                cost_decode: CostModel, link: Link = LINKS["IB-NDR"], *, layerwise: bool = True,
                max_num_batched_tokens: int = 8192, prefill_max_num_seqs: int = 64, max_num_seqs: int = 256,
                kv_capacity_tokens: tuple[int | None, int | None] = (None, None), gpu_memory_utilization: float = 0.9,
                ttft_slo_s: float = 1.0, tpot_slo_s: float = 0.05, autoscaler: Autoscaler | None = None,
                kv_bytes_per_token: float | None = None, num_layers: int | None = None) -> PDResult:
    """Run `requests` on `num_prefill` prefill and `num_decode` decode instances (module docstring).

    cost_prefill / cost_decode: one instance's step time (`StepCost`, `TPCost` for a TP group, any `CostModel`).
    link: between a prefill and a decode instance (per GPU; default 400 Gb/s InfiniBand). layerwise: send the KV
    layer by layer (else whole, after the prefill). max_num_batched_tokens / prefill_max_num_seqs: a prefill
    step's budget; max_num_seqs: a decode batch. kv_capacity_tokens: (prefill, decode) per instance; None: what
    the cost model's memory holds (unbounded on a CPU). kv_bytes_per_token / num_layers: default from
    cost_prefill's model shape (give them for a cost model without one). autoscaler: rebalance the pools as the
    queues say (`Autoscaler`; both pools' instances must have the same GPU count)."""
    if not all(isinstance(n, int) and n >= 1 for n in (num_prefill, num_decode)):
        raise ValueError(f"num_prefill and num_decode must be ints >= 1, got {num_prefill!r}, {num_decode!r}")
    if not isinstance(link, Link):
        raise ValueError(f"link must be a hardware.Link (e.g. hardware.LINKS['IB-NDR']), got {link!r}")
    if not requests:
        raise ValueError("requests is empty: pass at least one Request")
    model = getattr(cost_prefill, "model", None)
    if kv_bytes_per_token is None or num_layers is None:
        if model is None:
            raise ValueError("cost_prefill has no model shape: pass kv_bytes_per_token and num_layers")
        kv_bytes_per_token = kv_bytes_per_token or cost_prefill.kv_bytes_per_token
        num_layers = num_layers or model.num_layers
    if autoscaler and _tp(cost_prefill) != _tp(cost_decode):
        raise ValueError(f"autoscaling moves whole instances: give both pools the same tp "
                         f"(got {_tp(cost_prefill)} and {_tp(cost_decode)})")
    cfg_p = _pool_config(cost_prefill, prefill_max_num_seqs, max_num_batched_tokens, kv_capacity_tokens[0],
                         gpu_memory_utilization)
    cfg_d = _pool_config(cost_decode, max_num_seqs, max_num_seqs, kv_capacity_tokens[1], gpu_memory_utilization)
    for r in requests:
        if r.prompt_len + 1 > cfg_p.kv_capacity_tokens or r.prompt_len + r.output_len > cfg_d.kv_capacity_tokens:
            raise ValueError(f"request {r.request_id} ({r.prompt_len} + {r.output_len} tokens) does not fit one "
                             f"instance's KV (prefill {cfg_p.kv_capacity_tokens}, decode {cfg_d.kv_capacity_tokens} "
                             "tokens): raise kv_capacity_tokens or the tp")
    return _PDSim(list(requests), num_prefill, num_decode, cost_prefill, cost_decode, link, layerwise, cfg_p, cfg_d,
                  autoscaler, kv_bytes_per_token, num_layers, ttft_slo_s, tpot_slo_s).run()


def simulate_colocated(requests: Sequence[Request], num_replicas: int, cost: CostModel, *,
                       max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                       kv_capacity_tokens: int | None = None, gpu_memory_utilization: float = 0.9,
                       ttft_slo_s: float = 1.0, tpot_slo_s: float = 0.05) -> PDResult:
    """The same requests on `num_replicas` instances that each prefill and decode (chunked prefill: decodes first,
    then prompt chunks in the `max_num_batched_tokens` budget), least-loaded routing: `cluster.simulate_cluster`
    with no shared prefixes. Compare with `simulate_pd` at the same GPU count."""
    if not requests:
        raise ValueError("requests is empty: pass at least one Request")
    cfg = _pool_config(cost, max_num_seqs, max_num_batched_tokens, kv_capacity_tokens, gpu_memory_utilization,
                       num_replicas)
    res = simulate_cluster([_wrap(r, r.output_len) for r in requests], LeastLoaded(num_replicas), cost, cfg)
    duration = max(m.finish_time for m in res.requests) - min(m.arrival_time for m in res.requests)
    by_id = {m.request_id: m for m in res.requests}
    return PDResult([by_id[r.request_id] for r in requests], ttft_slo_s, tpot_slo_s, {"colocated": sum(res.busy_s)},
                    {"colocated": num_replicas * duration})
