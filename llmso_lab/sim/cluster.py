"""A cluster of replicas behind a router, each with its own prefix cache: a minimal discrete-event model.

`simulate` (`llmso_lab.sim.simulator`) models one engine and has no prefix cache; this models many, just
enough to compare routers (`llmso_lab.routing`) at scale. Each replica is a continuous-batching engine:

  admission  FCFS, up to `max_num_seqs` running. A request whose system prompt (`prefix_id`) is in the
             replica's cache and already computed reuses it (a hit: `prefix_len` tokens not recomputed);
             otherwise it computes its whole prompt, and the first such request stores the prefix in the
             cache once computed. Each request reserves KV for its own tokens (prompt beyond the cached
             prefix + its whole output) up front, so nothing is preempted; when that does not fit in
             `kv_capacity_tokens`, the least recently used cached prefixes that no running request uses are
             evicted, and if it still does not fit the request waits (head of line).
  step       decodes first (one token each), then prefill chunks of the waiting prompt tokens under the
             `max_num_batched_tokens` budget; its time is `cost.step_time(prefill, decode)` (a roofline).
  routing    at each arrival the router sees every replica's load: requests waiting or running there.

Not modelled: partial prefix matches (a prefix is hit whole or missed), block granularity, preemption,
the router's own latency. Times in seconds, sizes in tokens.
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from llmso_lab.routing import Router, stable_hash
from llmso_lab.sim.cost import CostModel
from llmso_lab.workloads import RequestMetrics, SharedPrefixRequest, percentiles

__all__ = ["ClusterConfig", "ClusterResult", "simulate_cluster", "routing_key"]


@dataclass(slots=True)
class ClusterConfig:
    num_replicas: int = 16
    max_num_seqs: int = 32                 # per replica
    max_num_batched_tokens: int = 4096     # per replica step
    kv_capacity_tokens: int = 65_536       # per replica: running requests' KV + cached prefixes

    def __post_init__(self) -> None:
        for name in ("num_replicas", "max_num_seqs", "max_num_batched_tokens", "kv_capacity_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")


def routing_key(req: SharedPrefixRequest) -> int:
    """The simulator's stand-in for `prefix_key(prompt)`: requests with the same system prompt share their
    leading blocks, hence their key (the workloads' prefixes are longer than the 4 blocks the key reads)."""
    return stable_hash(f"prefix-{req.prefix_id}".encode())


@dataclass(slots=True, eq=False)
class _Req:
    req: SharedPrefixRequest
    replica: int
    cached: int = 0          # prompt tokens reused from the prefix cache
    computed: int = 0        # prompt tokens with KV (cached ones included)
    generated: int = 0
    reserved: int = 0        # KV tokens reserved for it alone
    stores_prefix: bool = False   # this request computes the prefix that goes into the cache
    pins_prefix: bool = False     # it uses the cached (or being cached) prefix: not evictable meanwhile
    first_token_time: float = math.nan
    finish_time: float = math.nan


@dataclass(slots=True, eq=False)
class _Replica:
    cfg: ClusterConfig
    cost: CostModel
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    cache: OrderedDict = field(default_factory=OrderedDict)   # prefix_id -> tokens; LRU first; computed prefixes
    pending: set = field(default_factory=set)                 # prefixes being computed (stored when done)
    pins: Counter = field(default_factory=Counter)            # prefix_id -> running requests using it
    used: int = 0                                             # reserved + cached tokens
    step_end: float | None = None                             # None: idle
    work: list = field(default_factory=list)                  # (request, tokens) of the step in flight
    busy_s: float = 0.0

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def _make_room(self, need: int) -> bool:
        """Evict unused cached prefixes, least recently used first, until `need` tokens are free."""
        free = self.cfg.kv_capacity_tokens - self.used
        evictable = sum(t for p, t in self.cache.items() if not self.pins[p])
        if need > free + evictable:
            return False
        for p in [p for p in self.cache if not self.pins[p]]:
            if self.cfg.kv_capacity_tokens - self.used >= need:
                break
            self.used -= self.cache.pop(p)
        return True

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            r = self.waiting[0]
            q, hit = r.req, r.req.prefix_id in self.cache
            stores = not hit and q.prefix_id not in self.pending and q.prefix_len > 0
            own = q.prompt_len + q.output_len - (q.prefix_len if hit or stores else 0)
            if hit or stores:                  # pinned first, so that making room cannot evict it
                self.pins[q.prefix_id] += 1
            if not self._make_room(own + (q.prefix_len if stores else 0)):
                if hit or stores:
                    self.pins[q.prefix_id] -= 1
                return
            self.waiting.popleft()
            r.pins_prefix = hit or stores
            if hit:
                self.cache.move_to_end(q.prefix_id)
                r.cached = r.computed = q.prefix_len
            if stores:   # the prefix's KV counts as the cache's from now on (stored when computed)
                self.pending.add(q.prefix_id)
                self.used += q.prefix_len
                r.stores_prefix = True
            r.reserved = own
            self.used += own
            assert self.used <= self.cfg.kv_capacity_tokens
            self.running.append(r)

    def start_step(self, now: float) -> None:
        """Schedule one step at `now` (decodes, then prefill chunks); idle if there is nothing to run."""
        self._admit()
        budget, work = self.cfg.max_num_batched_tokens, []
        decodes = [r for r in self.running if r.computed == r.req.prompt_len]
        prefills = [r for r in self.running if r.computed < r.req.prompt_len]
        for r in decodes:
            work.append((r, 1))
        budget -= len(decodes)
        for r in prefills:
            n = min(r.req.prompt_len - r.computed, budget)
            if n <= 0:
                break
            work.append((r, n))
            budget -= n
        if not work:
            self.step_end = None
            return
        prefill = [(n, r.computed) for r, n in work if r.computed < r.req.prompt_len]
        decode = [r.req.prompt_len + r.generated for r, n in work if r.computed == r.req.prompt_len]
        dt = self.cost.step_time(prefill, decode)
        self.work, self.step_end, self.busy_s = work, now + dt, self.busy_s + dt

    def end_step(self) -> list[_Req]:
        """Apply the step that ends now (`step_end`); returns the requests it finished."""
        now, done = self.step_end, []
        for r, n in self.work:
            q = r.req
            if r.computed < q.prompt_len:
                r.computed += n
                if r.stores_prefix and r.computed >= q.prefix_len:
                    self.pending.discard(q.prefix_id)
                    self.cache[q.prefix_id] = q.prefix_len
                    r.stores_prefix = False
                if r.computed < q.prompt_len:
                    continue
            r.generated += 1          # the prompt's last chunk, or a decode, samples one token
            if r.generated == 1:
                r.first_token_time = now
            if r.generated == q.output_len:
                r.finish_time = now
                self.running.remove(r)
                self.used -= r.reserved
                if r.pins_prefix:
                    self.pins[q.prefix_id] -= 1
                done.append(r)
        self.work = []
        return done


@dataclass(slots=True)
class ClusterResult:
    router: str
    requests: list[RequestMetrics]
    replica: list[int]            # replica of each request
    cached_tokens: list[int]      # prompt tokens each request reused from its replica's prefix cache
    prompt_tokens: list[int]
    busy_s: list[float]           # per replica: seconds spent in steps

    def summary(self) -> dict:
        """Prefix hit rate (cached / prompt tokens), TTFT p50/p99 (s), load imbalance (max/mean requests per
        replica) and busy-time imbalance (max/mean seconds in steps per replica)."""
        counts = np.bincount(self.replica, minlength=len(self.busy_s))
        ttft = percentiles([m.ttft for m in self.requests], (50, 99))
        return {"router": self.router, "hit_rate": sum(self.cached_tokens) / sum(self.prompt_tokens),
                "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"],
                "load_imbalance": float(counts.max() / counts.mean()),
                "busy_imbalance": float(max(self.busy_s) / np.mean(self.busy_s))}


def simulate_cluster(requests: Sequence[SharedPrefixRequest], router: Router, cost: CostModel,
                     config: ClusterConfig | None = None) -> ClusterResult:
    """Route `requests` (in arrival order) over `config.num_replicas` replicas and run them (see the module
    docstring). The router gets `routing_key(request)` and the replicas' loads at the arrival time."""
    cfg = config or ClusterConfig()
    if router.num_replicas != cfg.num_replicas:
        raise ValueError(f"the router has {router.num_replicas} replicas but the cluster {cfg.num_replicas}")
    for q in requests:
        if q.prompt_len + q.output_len > cfg.kv_capacity_tokens:
            raise ValueError(f"request {q.request_id} needs {q.prompt_len + q.output_len} KV tokens but a replica "
                             f"holds {cfg.kv_capacity_tokens}: raise kv_capacity_tokens or shorten it")
    reps = [_Replica(cfg, cost) for _ in range(cfg.num_replicas)]
    todo = sorted(requests, key=lambda q: q.arrival_time)
    states, i = [], 0
    while i < len(todo) or any(rep.step_end is not None for rep in reps):
        busy = [rep for rep in reps if rep.step_end is not None]
        next_end = min((rep.step_end for rep in busy), default=math.inf)
        if i < len(todo) and todo[i].arrival_time <= next_end:    # next event: an arrival
            q, i = todo[i], i + 1
            k = router.route(routing_key(q), [rep.load for rep in reps])
            r = _Req(q, k)
            states.append(r)
            reps[k].waiting.append(r)
            if reps[k].step_end is None:
                reps[k].start_step(q.arrival_time)
        else:                                                     # next event: a replica's step ends
            rep = min(busy, key=lambda x: x.step_end)
            now = rep.step_end
            rep.end_step()
            rep.start_step(now)
            if rep.step_end is None and rep.waiting:
                raise RuntimeError("a replica stalled with requests waiting; this is a bug, please report it")
    metrics = [RequestMetrics(r.req.request_id, r.req.arrival_time, r.first_token_time, r.finish_time,
                              r.req.prompt_len, r.req.output_len) for r in states]
    return ClusterResult(router.name, metrics, [r.replica for r in states], [r.cached for r in states],
                         [r.req.prompt_len for r in states], [rep.busy_s for rep in reps])
