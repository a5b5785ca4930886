"""A shared KV pool read by several replicas (lecture 2-4: LMCache, Mooncake Store): when does fetching a prefix's
KV beat recomputing it, and how much more often does a pool shared by R replicas hit than R private caches?

Fetch or recompute, for a prompt of P cached-prefix tokens + S new tokens on one GPU (`StepCost`: its hardware,
model shape and MFU = `compute_efficiency`):

  recompute   the whole prompt's prefill at MFU. The prefix's share of it is
              prefix_flops(P) = 2 x matmul params x P + attention_flops(1) x P (P + 1) / 2
  fetch       lookup_latency + one message of P tokens of KV over `link` (`comm.kv_transfer_time`), then the
              suffix's prefill attending to the fetched prefix. Layer-wise: layer i's KV streams in while layer
              i - 1 of the suffix computes (LMCache's layer-wise retrieval), so part of the transfer hides.

Whole-prompt fetching pays when recompute_time(P) > lookup + link latency + P x kv_bytes_per_token / bandwidth,
whatever S is (the suffix costs the same either way). Compute grows like P^2 (attention) and P x params, the
transfer like P x KV bytes: a prefix must be long enough, and the smaller the model (or the more it shares KV
heads), the longer (`breakeven_prefix_tokens`, a quadratic's root; `breakeven_by_search` checks it).

Hit rate: requests pick documents (prefixes) with Zipf popularity; each replica's cache (or the pool) holds
`capacity` tokens of whole documents, least recently used evicted first (`LRUTokenCache`, replayed on a trace by
`replay_hits`). R private caches of C / R tokens each hold duplicates of the popular documents; one pool of C
tokens holds each once, so it reaches further down the popularity tail. `che_hit_rate` is the analytic
counterpart (Che's approximation of LRU under independent requests). `pool_vs_private` gives both hit rates and
the mean TTFT they save: a private hit is in the replica's own memory (saves the whole prefix recompute), a pool
hit saves recompute minus fetch (the engine recomputes instead when fetching does not pay).

What it leaves out: recompute is timed at MFU (compute-bound) even for short prefixes, where a GPU is really
bound by reading the weights (this marginal-cost view is right when the prefix is part of a longer prefill); no
queueing at the pool or the link; partial-document (block) hits; the pool's own memory tier (DRAM, SSD) is folded
into `link` and `lookup_latency_s`. Units: seconds, tokens, bytes.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from llmso_lab.disagg.transfer import transfer_timeline
from llmso_lab.hardware import Link
from llmso_lab.sim.comm import kv_transfer_time
from llmso_lab.sim.cost import StepCost
from llmso_lab.workloads import zipf_weights

__all__ = ["prefix_flops", "recompute_time", "fetch_time", "ttft", "fetch_pays", "breakeven_prefix_tokens",
           "breakeven_by_search", "zipf_trace", "LRUTokenCache", "replay_hits", "che_hit_rate", "pool_vs_private"]

MODES = ("recompute", "fetch", "fetch_layerwise")


def _check_tokens(**named: int) -> None:
    for name, v in named.items():
        if not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be an int >= 0 (tokens), got {v!r}")


def _kv_bytes(cost: StepCost) -> float:
    return cost.kv_dtype_bytes or cost.dtype_bytes


# ---- fetch vs recompute ------------------------------------------------------------------------------------------
def prefix_flops(cost: StepCost, prefix_tokens: int) -> float:
    """FLOPs of computing a `prefix_tokens`-token prefix's KV: 2 x matmul params per token + causal attention
    (P (P + 1) / 2 query-key pairs). No logits: nothing is sampled from a prefix. Equals
    cost.work([(P + S, 0)]) - cost.work([(S, P)]) for any suffix S."""
    _check_tokens(prefix_tokens=prefix_tokens)
    m, p = cost.model, prefix_tokens
    return float(2 * m.body_matmul_params() * p + m.attention_flops(1) * p * (p + 1) // 2)


def _flops_per_s(cost: StepCost) -> float:
    return cost.hardware.peak_flops * cost.compute_efficiency


def recompute_time(cost: StepCost, prefix_tokens: int) -> float:
    """Seconds to recompute the prefix's KV: `prefix_flops` at peak FLOP/s x MFU (`cost.compute_efficiency`)."""
    return prefix_flops(cost, prefix_tokens) / _flops_per_s(cost)


def fetch_time(cost: StepCost, prefix_tokens: int, link: Link, lookup_latency_s: float) -> float:
    """Seconds to fetch the prefix's KV from the pool in one message: lookup + `comm.kv_transfer_time`
    (link latency + P x kv_bytes_per_token / bandwidth). 0 for an empty prefix (nothing to look up)."""
    _check_tokens(prefix_tokens=prefix_tokens)
    if not lookup_latency_s >= 0:
        raise ValueError(f"lookup_latency_s must be >= 0 seconds, got {lookup_latency_s!r}")
    if prefix_tokens == 0:
        return 0.0
    return lookup_latency_s + kv_transfer_time(cost.model, prefix_tokens, link, _kv_bytes(cost))


def ttft(cost: StepCost, prefix_tokens: int, suffix_tokens: int, link: Link, lookup_latency_s: float,
         mode: str = "fetch") -> float:
    """Prefill time of a prompt of `prefix_tokens` (in the pool) + `suffix_tokens` (new) tokens, compute at MFU:

      "recompute"        the whole prompt: cost.work([(P + S, 0)]) FLOPs
      "fetch"            fetch_time(P), then the suffix: cost.work([(S, P)]) FLOPs
      "fetch_layerwise"  lookup, then a pipeline over the layers: layer i's KV (1 / L of the bytes, one message)
                         arrives, then the suffix's layer i computes (after its layer i - 1). This is the two-stage
                         pipeline `disagg.transfer.transfer_timeline` times, with the roles swapped (there compute
                         feeds the link; here the link feeds compute)."""
    _check_tokens(prefix_tokens=prefix_tokens, suffix_tokens=suffix_tokens)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    F = _flops_per_s(cost)
    if mode == "recompute":
        return cost.work([(prefix_tokens + suffix_tokens, 0)])[0] / F
    suffix_s = cost.work([(suffix_tokens, prefix_tokens)])[0] / F
    if mode == "fetch" or prefix_tokens == 0:
        return fetch_time(cost, prefix_tokens, link, lookup_latency_s) + suffix_s
    L = cost.model.num_layers
    per_layer = link.transfer_time(cost.model.kv_cache_bytes(prefix_tokens, 1, _kv_bytes(cost)) / L)
    return lookup_latency_s + transfer_timeline([per_layer] * L, [suffix_s / L] * L)[-1][1]


def fetch_pays(cost: StepCost, prefix_tokens: int, link: Link, lookup_latency_s: float, suffix_tokens: int = 0,
               layerwise: bool = False) -> bool:
    """True when fetching the prefix gives a strictly smaller TTFT than recomputing it (`ttft`)."""
    mode = "fetch_layerwise" if layerwise else "fetch"
    return (ttft(cost, prefix_tokens, suffix_tokens, link, lookup_latency_s, mode)
            < ttft(cost, prefix_tokens, suffix_tokens, link, lookup_latency_s, "recompute"))


def breakeven_prefix_tokens(cost: StepCost, link: Link, lookup_latency_s: float) -> int:
    """Smallest prefix length P at which a whole (not layer-wise) fetch pays, for any suffix length.

    With F = peak x MFU, a = 2 x matmul params / F, b = attention_flops(1) / F (s per query-key pair),
    k = kv_bytes_per_token / bandwidth and c = lookup + link latency, fetching pays when
        a P + b P (P + 1) / 2 > c + k P   <=>   (b / 2) P^2 + (a + b / 2 - k) P - c > 0.
    The quadratic is -c <= 0 at P = 0 and grows without bound, so it has one root P* >= 0 and pays beyond it:
        P* = (-B + sqrt(B^2 + 2 b c)) / b,   B = a + b / 2 - k.
    Returns floor(P*) + 1 (the first integer strictly past the root), at least 1."""
    if not lookup_latency_s >= 0:
        raise ValueError(f"lookup_latency_s must be >= 0 seconds, got {lookup_latency_s!r}")
    F, m = _flops_per_s(cost), cost.model
    a, b = 2 * m.body_matmul_params() / F, m.attention_flops(1) / F
    k, c = m.kv_bytes_per_token(_kv_bytes(cost)) / link.bandwidth, lookup_latency_s + link.latency
    B = a + b / 2 - k
    root = (-B + math.sqrt(B * B + 2 * b * c)) / b
    p = max(1, math.floor(root) + 1)
    # float rounding at the root: step to the exact integer answer (at most a step or two)
    while p > 1 and fetch_pays(cost, p - 1, link, lookup_latency_s):
        p -= 1
    while not fetch_pays(cost, p, link, lookup_latency_s):
        p += 1
    return p


def breakeven_by_search(cost: StepCost, link: Link, lookup_latency_s: float, suffix_tokens: int = 0,
                        layerwise: bool = False, max_tokens: int = 1 << 40) -> int:
    """Smallest P with `fetch_pays(...)`, by doubling then bisection: the check of the closed form, and the only
    answer for layer-wise fetching (which depends on the suffix). Assumes one crossover (false below it, true
    above), which holds here: recompute grows faster than the transfer. ValueError past `max_tokens`."""
    pays = lambda p: fetch_pays(cost, p, link, lookup_latency_s, suffix_tokens, layerwise)
    hi = 1
    while not pays(hi):
        hi *= 2
        if hi > max_tokens:
            raise ValueError(f"fetching never pays below max_tokens={max_tokens}: raise it or check the link")
    lo = hi // 2                      # pays(lo) is False (or lo = 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pays(mid) else (mid, hi)
    return hi


# ---- hit rates: a pool shared by R replicas vs R private caches ----------------------------------------------------
def zipf_trace(num_requests: int, num_docs: int, zipf_s: float = 1.0, seed: int = 0) -> list[int]:
    """`num_requests` document ids in 0..num_docs-1 drawn independently with Zipf popularity (doc 0 the most
    popular; `workloads.zipf_weights`). Seeded."""
    if num_requests < 0 or num_docs < 1:
        raise ValueError(f"need num_requests >= 0 and num_docs >= 1, got {num_requests} and {num_docs}")
    rng = np.random.default_rng(seed)
    return rng.choice(num_docs, size=num_requests, p=zipf_weights(num_docs, zipf_s)).tolist()


class LRUTokenCache:
    """Whole documents cached by id, `capacity_tokens` in all; a miss inserts the document at the most-recent end
    and evicts least recently used documents until it fits. A document longer than the whole cache bypasses it
    (not cached, nothing evicted)."""

    def __init__(self, capacity_tokens: int) -> None:
        _check_tokens(capacity_tokens=capacity_tokens)
        self.capacity_tokens = capacity_tokens
        self.used = 0
        self._docs: OrderedDict[int, int] = OrderedDict()   # doc id -> tokens, least recent first

    def __contains__(self, doc: int) -> bool:
        return doc in self._docs

    def access(self, doc: int, tokens: int) -> bool:
        """Look the document up (a hit refreshes it); on a miss, insert it. Returns True on a hit."""
        if doc in self._docs:
            self._docs.move_to_end(doc)
            return True
        if tokens <= self.capacity_tokens:
            while self.used + tokens > self.capacity_tokens:
                self.used -= self._docs.popitem(last=False)[1]
            self._docs[doc] = tokens
            self.used += tokens
        return False


def replay_hits(trace: Sequence[int], doc_tokens: Sequence[int], num_replicas: int, capacity_tokens: int,
                shared: bool) -> list[bool]:
    """Hit (True) or miss per request of `trace` (document ids; doc d has doc_tokens[d] tokens). Request i goes
    to replica i % num_replicas (round robin: no prefix-aware routing). shared=True: all replicas read one pool of
    `capacity_tokens`; False: each replica has its own LRU of capacity_tokens // num_replicas (equal total)."""
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if any(not 0 <= d < len(doc_tokens) for d in trace):
        raise ValueError(f"trace has document ids outside 0..{len(doc_tokens) - 1}: give doc_tokens for every doc")
    caches = [LRUTokenCache(capacity_tokens)] if shared else \
        [LRUTokenCache(capacity_tokens // num_replicas) for _ in range(num_replicas)]
    return [caches[0 if shared else i % num_replicas].access(d, doc_tokens[d]) for i, d in enumerate(trace)]


def che_hit_rate(popularity: Sequence[float], doc_tokens: Sequence[int], capacity_tokens: float) -> float:
    """Che's approximation of an LRU cache's hit rate under independent requests: the characteristic time T
    solves sum_d tokens_d (1 - exp(-p_d T)) = capacity (each document is in the cache if it was requested within
    the last T requests), and the hit rate is sum_d p_d (1 - exp(-p_d T)). R private caches fed round robin each
    see the same popularity, so their hit rate is che_hit_rate(p, tokens, C / R)."""
    p, s = np.asarray(popularity, dtype=float), np.asarray(doc_tokens, dtype=float)
    if p.shape != s.shape or p.ndim != 1 or (p < 0).any() or not math.isclose(p.sum(), 1.0, rel_tol=1e-6):
        raise ValueError("popularity must be a probability vector with one entry per document in doc_tokens")
    if capacity_tokens >= s[p > 0].sum():
        return 1.0        # everything requested fits: only first requests miss, none in the long run
    occupancy = lambda t: float((s * -np.expm1(-p * t)).sum())
    lo, hi = 0.0, 1.0
    while occupancy(hi) < capacity_tokens:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if occupancy(mid) < capacity_tokens else (lo, mid)
    return float((p * -np.expm1(-p * hi)).sum())


@dataclass(frozen=True, slots=True)
class PoolComparison:
    """`pool_vs_private`'s answer; hit rates are over the trace's requests, savings in seconds per request."""

    private_hit_rate: float
    shared_hit_rate: float
    private_che: float            # Che's approximation of each
    shared_che: float
    private_ttft_saved_s: float   # mean over all requests (misses save 0)
    shared_ttft_saved_s: float
    fetch_pays_for: float         # fraction of documents whose fetch beats recompute


def pool_vs_private(cost: StepCost, link: Link, lookup_latency_s: float, doc_tokens: Sequence[int],
                    num_replicas: int, capacity_tokens: int, num_requests: int = 20000, zipf_s: float = 1.0,
                    seed: int = 0) -> PoolComparison:
    """Replay a Zipf trace over the documents against R private caches and one shared pool of the same total
    capacity (`replay_hits`), with Che's approximation beside each, and the mean TTFT each saves per request: a
    private hit saves recompute_time(P); a pool hit saves max(0, recompute_time(P) - fetch_time(P))."""
    trace = zipf_trace(num_requests, len(doc_tokens), zipf_s, seed)
    private = replay_hits(trace, doc_tokens, num_replicas, capacity_tokens, shared=False)
    shared = replay_hits(trace, doc_tokens, num_replicas, capacity_tokens, shared=True)
    saved_local = [recompute_time(cost, t) for t in doc_tokens]
    saved_pool = [max(0.0, r - fetch_time(cost, t, link, lookup_latency_s)) for r, t in zip(saved_local, doc_tokens)]
    pop = zipf_weights(len(doc_tokens), zipf_s)
    n = max(len(trace), 1)
    return PoolComparison(
        private_hit_rate=sum(private) / n, shared_hit_rate=sum(shared) / n,
        private_che=che_hit_rate(pop, doc_tokens, capacity_tokens // num_replicas),
        shared_che=che_hit_rate(pop, doc_tokens, capacity_tokens),
        private_ttft_saved_s=sum(saved_local[d] for d, h in zip(trace, private) if h) / n,
        shared_ttft_saved_s=sum(saved_pool[d] for d, h in zip(trace, shared) if h) / n,
        fetch_pays_for=float(np.mean([s > 0 for s in saved_pool])))
