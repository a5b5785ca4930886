"""Lab 04 (PagedAttention, copy-on-write, prefix caching, prefix-aware routing) exercises and their public checks.

References: `llmso_lab.kv.fragmentation:waste`, `llmso_lab.kv.tables:BlockAllocator` (over the engine's
`BlockManager`), `llmso_lab.kv.block_manager:block_hash_chain` / `cached_prefix_tokens`,
`llmso_lab.kv.radix:RadixTree` (the engine's radix prefix cache, used here without KV blocks) and
`llmso_lab.routing:ring_bounded_pick` (graded by running it: `routing.route_stream` routes a stream of requests
with arrivals and departures through the student's pick). All inputs are small literals.

The prefix-cache exercise accepts any key scheme: its comparator checks which keys are EQUAL (block i of one
prompt has the same key as block j of another exactly when the reference's keys are equal), not their values, so
a sha256 chain or a tuple of the whole prefix passes and a hash of a block's own tokens does not.
"""
from __future__ import annotations

from typing import Any

from llmso_lab.grading.compare import Comparator, close, exact
from llmso_lab.grading.registry import Case, Exercise, register
from llmso_lab.kv.block_manager import block_hash_chain, cached_prefix_tokens
from llmso_lab.routing import PrefixAware, stable_hash

same = exact()
ratio = close(atol=1e-12, rtol=1e-9)   # a share computed in any order: float rounding only


# ---- kv_waste ----------------------------------------------------------------------------------------
_chat = [(653, 97), (557, 155), (101, 476), (29, 1024), (64, 1024), (35, 120), (210, 33), (96, 301)]  # chat_lengths.json


# ---- BlockAllocator: method-call sequences -----------------------------------------------------------
def call(method: str, *args) -> tuple[str, tuple, dict]:
    return (method, args, {})


FREE, REFS = "num_free_blocks", "ref_counts"


# ---- prefix_cache_hits ---------------------------------------------------------------------------------
def prefix_cache_hits_oracle(prompts: list[list[int]], block_size: int) -> dict:
    """What the notebook's `prefix_cache_hits` returns, with the library's functions: every prompt's keys, and the
    tokens each prompt finds in a cache holding the keys of the prompts before it."""
    cache, keys, hits = set(), [], []
    for p in prompts:
        hits.append(cached_prefix_tokens(p, cache, block_size))
        keys.append(block_hash_chain(p, block_size))
        cache.update(keys[-1])
    return {"keys": keys, "hit_tokens": hits}


def _hashable(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(v) for v in x)
    if isinstance(x, (int, str)) and not isinstance(x, bool):
        return x
    raise TypeError(type(x).__name__)


def same_key_structure() -> Comparator:
    """{"keys": [[key per full block] per prompt], "hit_tokens": [int per prompt]}: the keys are compared by which of
    them are equal to which (any key scheme with the same equalities passes), the hit counts exactly."""

    def cmp(got: Any, exp: Any) -> str | None:
        if not isinstance(got, dict) or set(got) != {"keys", "hit_tokens"}:
            return f"expected a dict with keys 'keys' and 'hit_tokens', got {type(got).__name__}"
        gk, ek = got["keys"], exp["keys"]
        if not isinstance(gk, (list, tuple)) or len(gk) != len(ek):
            return f"'keys': expected one list of keys per prompt ({len(ek)} prompts)"
        first: dict[Any, tuple[int, int]] = {}   # got key -> where it first appeared
        where: dict[Any, tuple[int, int]] = {}   # expected key -> where it first appeared
        for p, (g_row, e_row) in enumerate(zip(gk, ek)):
            if not isinstance(g_row, (list, tuple)) or len(g_row) != len(e_row):
                n = len(g_row) if isinstance(g_row, (list, tuple)) else type(g_row).__name__
                return (f"prompt {p}: {n} keys, expected {len(e_row)} (one per FULL block; a partial last block "
                        "has no key)")
            for i, (g, e) in enumerate(zip(g_row, e_row)):
                try:
                    g = _hashable(g)
                except TypeError as exc:
                    return f"prompt {p}, block {i}: a key is an int, a str or a tuple of them, got a {exc}"
                at_g, at_e = first.setdefault(g, (p, i)), where.setdefault(e, (p, i))
                if at_g != at_e:
                    if at_e == (p, i):
                        q, j = at_g
                        return (f"prompt {p} block {i} has the same key as prompt {q} block {j}, but their prefixes "
                                f"differ (the tokens of block {i} or of an earlier block): its K/V differs, so its key "
                                f"must differ too")
                    q, j = at_e
                    return (f"prompt {p} block {i} and prompt {q} block {j} end the same prefix (same tokens from "
                            f"position 0), so they must have the same key")
        hits = got["hit_tokens"]
        if not isinstance(hits, (list, tuple)) or len(hits) != len(exp["hit_tokens"]) or any(
                type(h) is not int or h != e for h, e in zip(hits, exp["hit_tokens"])):
            return f"'hit_tokens': expected {exp['hit_tokens']}, got {hits!r}"[:300]
        return None

    return cmp


# ---- bounded_load_pick: request streams for `routing.route_stream` --------------------------------------
def zipf_keys(n: int, num_prefixes: int, seed: int, s: float = 1.1) -> list[int]:
    """Routing keys of n requests whose prefixes (system prompts) are Zipf-popular: a few keys repeat a lot."""
    import random
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** s for i in range(num_prefixes)]
    return [stable_hash(f"prefix-{seed}-{i}".encode()) for i in rng.choices(range(num_prefixes), weights, k=n)]


def ring_edge_keys(num_replicas: int, vnodes: int = 16) -> list[int]:
    """Keys exactly on ring points, one past them, before the first point and after the last (wrap-around), each a
    few times so that loads build up."""
    pts = PrefixAware(num_replicas, vnodes).points
    one = [pts[0], pts[0] + 1, pts[5], pts[5] - 1, 0, pts[-1], pts[-1] + 1, 2**64 - 1, pts[len(pts) // 2]]
    return [k for k in one for _ in range(3)]


X, Y, Z, W = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]   # blocks of 4 tokens


register(
    Exercise("kv_waste", "04", 10, "llmso_lab.kv.fragmentation:waste", [
        Case("contiguous, max_model_len 128, at finish", ([(10, 5), (100, 28), (3, 1)], "contiguous_max_len"),
             {"moment": "at_finish", "max_model_len": 128}),
        Case("contiguous, prompt + max_tokens (32), over each sequence's lifetime",
             ([(10, 5), (100, 28), (3, 1)], "contiguous_max_tokens"), {"moment": "lifetime", "max_tokens": 32}),
        Case("paged, block 16, lifetime (only the last block has empty slots)",
             ([(10, 5), (100, 28), (3, 1)], "paged"), {"moment": "lifetime", "block_size": 16}),
        Case("paged, block 4, at finish: 8 + 4 tokens fill their blocks exactly", ([(8, 4), (5, 2)], "paged"),
             {"moment": "at_finish", "block_size": 4}),
        Case("eight requests of chat_lengths.json, contiguous 2048, lifetime", (_chat, "contiguous_max_len"),
             {"moment": "lifetime", "max_model_len": 2048}),
    ], compare=ratio, tripwires=("llmso_lab.kv.fragmentation:reserved_slots", "llmso_lab.kv.fragmentation:_states",
                                 "llmso_lab.kv.fragmentation:max_batch", "llmso_lab.bench.paged:engine_waste"),
        description="share of reserved KV slots that hold no token, by allocation scheme"),
    Exercise("BlockAllocator", "04", 30, "llmso_lab.kv.tables:BlockAllocator", [
        Case("allocate two prompts, free one", (8, 4), calls=[
            call("allocate", 0, 6), call(FREE), call("allocate", 1, 9), call(FREE), call(REFS, 1), call("free", 0),
            call(FREE)]),
        Case("fork shares every block (ref count 2) and copies nothing", (10, 4), calls=[
            call("allocate", "p", 7), call("fork", "p", "c"), call(REFS, "p"), call(REFS, "c"), call(FREE)]),
        Case("copy-on-write: the child writes into the shared last block, then the parent writes alone", (10, 4), calls=[
            call("allocate", "p", 7), call("fork", "p", "c"), call("append", "c"), call(REFS, "c"), call(REFS, "p"),
            call(FREE), call("append", "p"), call("append", "p", 2), call(REFS, "p"), call(FREE)]),
        Case("freeing a forked parent keeps the shared blocks for the child", (10, 4), calls=[
            call("allocate", "p", 8), call("fork", "p", "c"), call("free", "p"), call(REFS, "c"), call(FREE),
            call("free", "c"), call(FREE)]),
        Case("out of blocks: MemoryError, and nothing changes", (4, 4), calls=[
            call("allocate", "a", 12), call("allocate", "b", 8), call(FREE), call("fork", "a", "c"),
            call("append", "c"), call("append", "a"), call(FREE), call(REFS, "a")]),
    ], kind="class", compare=same, tripwires=("llmso_lab.kv.block_manager:BlockManager",),
        description="a ref-counted KV block allocator with fork and copy-on-write"),
    Exercise("prefix_cache_hits", "04", 20, "llmso_lab.kv.block_manager:block_hash_chain", [
        Case("two prompts share two blocks, then diverge", ([list(range(1, 11)), list(range(1, 9)) + [50, 51, 52, 53, 54]], 4)),
        Case("the same block after a different prefix is a different block", ([X + Y + Z, W + Y + Z, X + Y + W + [1]], 4)),
        Case("the walk stops at the first miss (Y X after X Y finds nothing)", ([X + Y + [0], Y + X + [0]], 4)),
        Case("a repeated block, a partial last block, a fully cached prompt (its last block is computed again)",
             ([X + X + [1, 2], X + X + [1, 2], X + X], 4)),
    ], compare=same_key_structure(), oracle="llmso_lab.grading.specs.lab04:prefix_cache_hits_oracle",
        tripwires=("llmso_lab.kv.block_manager:cached_prefix_tokens", "llmso_lab.kv.block_manager:hash_block",
                   "llmso_lab.kv.block_manager:BlockManager"),
        description="hash-chain keys of full blocks, and the longest cached prefix a cache of them serves"),
    Exercise("RadixTree", "04", 20, "llmso_lab.kv.radix:RadixTree", [
        Case("two prompts that diverge inside an edge: the edge splits", (), calls=[
            call("insert", [1, 2, 3, 4, 5]), call("insert", [1, 2, 3, 9, 9]), call("num_nodes"),
            call("match_prefix", [1, 2, 3, 4, 7]), call("match_prefix", [1, 2, 7]), call("match_prefix", [5])]),
        Case("a match may end inside an edge (token granularity)", (), calls=[
            call("insert", list(range(10, 21))), call("match_prefix", [10, 11, 12, 0]), call("num_nodes"),
            call("match_prefix", list(range(10, 30)))]),
        Case("a prefix of a path splits it; an extension adds a leaf; the same list twice changes nothing", (), calls=[
            call("insert", [1, 2, 3, 4]), call("insert", [1, 2]), call("num_nodes"), call("insert", [1, 2, 3, 4, 5, 6]),
            call("num_nodes"), call("insert", [1, 2, 3, 4]), call("num_nodes"), call("match_prefix", [1, 2, 3, 4, 5])]),
        Case("different first tokens: different children of the root", (), calls=[
            call("insert", [5, 1]), call("insert", [6, 1]), call("insert", [7, 1]), call("num_nodes"),
            call("match_prefix", [6, 1, 1]), call("match_prefix", [8])]),
    ], kind="class", compare=same, tripwires=("llmso_lab.kv.block_manager:BlockManager",),
        description="a token-level radix tree: insert (splitting edges), longest cached prefix, node count"),
    Exercise("bounded_load_pick", "04", 20, "llmso_lab.routing:ring_bounded_pick", [
        Case("an idle cluster (each request leaves before the next): every key goes to its home", (6, zipf_keys(40, 8, 1), 1.25, 1)),
        Case("Zipf-hot prefixes, c = 1.25: a hot home overflows to the next replica on the ring", (6, zipf_keys(150, 20, 2), 1.25, 24)),
        Case("c = 1: loads stay perfectly even", (5, zipf_keys(100, 10, 3), 1.0, 20)),
        Case("keys at, between, before and after the ring's points (the walk wraps around)", (4, ring_edge_keys(4), 1.5, 3)),
    ], harness="llmso_lab.routing:route_stream", compare=same,
        tripwires=("llmso_lab.routing:bounded_load_pick", "llmso_lab.routing:PrefixAwareBounded",
                   "llmso_lab.routing:PrefixAware.candidates"),   # the ring walk: the harness's own, in the grader
        description="consistent hashing with bounded loads: walk the hash ring from the key, skip replicas over the bound"),
)
