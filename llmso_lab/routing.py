"""Routers: which replica serves the next request (lecture 1-1, prefix-aware routing).

Every replica keeps its own prefix cache, so where a request goes decides whether its system prompt is
already cached there. A router sees the request's routing key and the replicas' current loads (requests
waiting or running on each) and returns a replica index:

  round_robin           replica 0, 1, 2, ... in turn: even load, but each replica sees every prefix, so a
                        cache holds only a share of them and misses the rest
  least_loaded          the replica with the fewest outstanding requests (ties: the lowest index)
  prefix_aware          the key (a hash of the prompt's leading blocks, `prefix_key`) picks the replica on a
                        consistent-hash ring: the same prefix always goes to the same replica (hits), but a
                        popular prefix sends all its traffic to one replica (a hot spot)
  prefix_aware_bounded  consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018):
                        walk the ring from the key's point and take the first replica whose load after this
                        request stays <= ceil(c * mean load after this request); c >= 1 trades hits for balance

SGLang's router (`--policy cache_aware`) and vLLM's production stack route by prefix in the same spirit (with a
radix tree of routed prefixes, or a session key, instead of a hash ring).
"""
from __future__ import annotations

import bisect
import hashlib
import math
from typing import Iterable, Sequence

import numpy as np

__all__ = ["ROUTERS", "prefix_key", "stable_hash", "bounded_load_pick", "ring_bounded_pick", "route_stream", "Router", "RoundRobin", "LeastLoaded",
           "PrefixAware", "PrefixAwareBounded", "make_router"]

ROUTERS = ("round_robin", "least_loaded", "prefix_aware", "prefix_aware_bounded")


def stable_hash(data: bytes) -> int:
    """A 64-bit hash that is the same in every process and on every machine (Python's `hash` of str is not)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_key(token_ids: Sequence[int], block_size: int = 16, num_blocks: int = 4) -> int:
    """Routing key of a prompt: a stable hash of its first `num_blocks` full blocks of `block_size` tokens (all
    its full blocks if it has fewer; the whole prompt if it has none). Prompts that share that many leading
    tokens (a system prompt) share the key; a shorter shared prefix does not make them share it."""
    if block_size < 1 or num_blocks < 1:
        raise ValueError(f"block_size and num_blocks must be >= 1, got {block_size} and {num_blocks}")
    if len(token_ids) == 0:
        raise ValueError("an empty prompt has no routing key: give at least one token")
    full = min(num_blocks, len(token_ids) // block_size) * block_size
    lead = token_ids[:full] if full else token_ids
    return stable_hash(np.asarray(lead, dtype=np.int64).tobytes())


class Router:
    """Picks a replica for each request. `route(key, loads)`: `key` from `prefix_key` (ignored by the load-only
    routers), `loads[i]` = requests outstanding on replica i now. Deterministic: same calls, same answers."""

    name = "router"

    def __init__(self, num_replicas: int) -> None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        self.num_replicas = num_replicas

    def route(self, key: int, loads: Sequence[int]) -> int:
        if len(loads) != self.num_replicas:
            raise ValueError(f"got {len(loads)} loads for {self.num_replicas} replicas: pass one load per replica")
        if min(loads) < 0:
            raise ValueError(f"loads are outstanding request counts, >= 0; got {list(loads)}")
        return self._pick(key, loads)

    def _pick(self, key: int, loads: Sequence[int]) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self.next = 0

    def _pick(self, key: int, loads: Sequence[int]) -> int:
        i, self.next = self.next, (self.next + 1) % self.num_replicas
        return i


class LeastLoaded(Router):
    name = "least_loaded"

    def _pick(self, key: int, loads: Sequence[int]) -> int:
        return min(range(self.num_replicas), key=lambda i: loads[i])


class PrefixAware(Router):
    """Consistent hashing: each replica owns `vnodes` points on a ring of 64-bit hashes; a key goes to the owner
    of the first point at or after it (wrapping around). Adding a replica moves only ~1/n of the keys."""

    name = "prefix_aware"

    def __init__(self, num_replicas: int, vnodes: int = 64) -> None:
        super().__init__(num_replicas)
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        ring = sorted((stable_hash(f"replica-{r}-vnode-{v}".encode()), r)
                      for r in range(num_replicas) for v in range(vnodes))
        self.points = [p for p, _ in ring]
        self.owners = [r for _, r in ring]

    def candidates(self, key: int):
        """Replicas in ring order from `key`'s point, each once: the first is the key's home."""
        start, seen = bisect.bisect_left(self.points, key), set()
        for j in range(len(self.points)):
            r = self.owners[(start + j) % len(self.points)]
            if r not in seen:
                seen.add(r)
                yield r

    def _pick(self, key: int, loads: Sequence[int]) -> int:
        return next(self.candidates(key))


class PrefixAwareBounded(PrefixAware):
    """`PrefixAware`, but a replica whose load would exceed ceil(c * mean load) after taking the request is
    skipped for the next one on the ring. Such a replica always exists for c >= 1 (they cannot all be full)."""

    name = "prefix_aware_bounded"

    def __init__(self, num_replicas: int, c: float = 1.25, vnodes: int = 64) -> None:
        super().__init__(num_replicas, vnodes)
        if not c >= 1.0:
            raise ValueError(f"c must be >= 1 (a replica may hold c times the mean load; 1.25 is typical), got {c}")
        self.c = c

    def capacity(self, loads: Sequence[int]) -> int:
        """The most requests a replica may hold once this request is placed."""
        return math.ceil(self.c * (sum(loads) + 1) / self.num_replicas)

    def _pick(self, key: int, loads: Sequence[int]) -> int:
        return bounded_load_pick(self.candidates(key), loads, self.c)


def bounded_load_pick(candidates: Iterable[int], loads: Sequence[int], c: float) -> int:
    """Consistent hashing with bounded loads, one decision: the first of `candidates` (replicas in the key's ring
    order, its home first) whose load stays <= ceil(c * (sum(loads) + 1) / len(loads)) once it takes this request."""
    cap = math.ceil(c * (sum(loads) + 1) / len(loads))
    return next(r for r in candidates if loads[r] + 1 <= cap)


def ring_bounded_pick(ring: Sequence[tuple[int, int]], key: int, loads: Sequence[int], c: float) -> int:
    """Consistent hashing with bounded loads, from the ring itself: `ring` is [(point, replica), ...] sorted by point
    (each replica owns several points). The key's home is the owner of the first point >= key (past the last point,
    wrap to the first); walk the ring clockwise from there and take the first replica whose load after this request
    stays <= ceil(c * (sum(loads) + 1) / len(loads)). Each replica is considered once."""
    if not ring:
        raise ValueError("the ring has no points: give each replica at least one")
    start = bisect.bisect_left([p for p, _ in ring], key)
    cap = math.ceil(c * (sum(loads) + 1) / len(loads))
    for j in range(len(ring)):
        r = ring[(start + j) % len(ring)][1]
        if loads[r] + 1 <= cap:
            return r
    raise ValueError(f"no replica below the bound {cap}: c must be >= 1, got {c}")


def route_stream(pick, num_replicas: int, keys: Sequence[int], c: float, hold: int, vnodes: int = 16) -> dict:
    """Harness of Lab 04's `bounded_load_pick`: run a stream of requests through a router whose decision is `pick`.

    `pick(ring, key, loads, c) -> replica` gets the ring [(point, replica), ...] of `PrefixAware(num_replicas,
    vnodes)` sorted by point, the request's routing key, a copy of the current loads and c. Request i arrives,
    is placed on the picked replica, and leaves once `hold` later requests have arrived (so loads rise and fall like a
    serving cluster's). Returns plain data: every pick, the largest load any replica reached, and the share of
    requests served by their key's home replica (prefix-cache affinity)."""
    if num_replicas < 1 or hold < 1:
        raise ValueError(f"num_replicas and hold must be >= 1, got {num_replicas} and {hold}")
    base = PrefixAware(num_replicas, vnodes)
    ring = list(zip(base.points, base.owners))
    loads, picks, home = [0] * num_replicas, [], 0
    peak = 0
    for i, key in enumerate(keys):
        if i >= hold:
            loads[picks[i - hold]] -= 1   # request i - hold finishes
        r = pick(list(ring), key, list(loads), c)
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= int(r) < num_replicas:
            raise ValueError(f"pick returned {r!r}: it must be a replica index in 0..{num_replicas - 1}")
        r = int(r)
        home += r == next(base.candidates(key))
        loads[r] += 1
        peak = max(peak, loads[r])
        picks.append(r)
    return {"picks": picks, "peak_load": peak, "home_share": round(home / max(1, len(keys)), 9)}


def make_router(name: str, num_replicas: int, **kwargs) -> Router:
    """A router by name (`ROUTERS`); kwargs: `vnodes` for the prefix routers, `c` for the bounded one."""
    classes = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_aware": PrefixAware,
               "prefix_aware_bounded": PrefixAwareBounded}
    if name not in classes:
        raise ValueError(f"unknown router {name!r}; use one of {', '.join(ROUTERS)}")
    return classes[name](num_replicas, **kwargs)
