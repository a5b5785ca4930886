"""Shared KV pool (lecture 2-4): fetch vs recompute against hand arithmetic, the closed-form breakeven against a
brute-force scan and bisection, LRU against a brute-force definition, Che's approximation against the replay, and
a shared pool hitting at least as often as private caches of the same total size."""
import math

import numpy as np
import pytest

from llmso_lab.hardware import ACCELERATORS, LINKS, Accelerator, Link
from llmso_lab.models.shapes import LLAMA3_70B, LLAMA3_8B, SMOLLM2_135M, ModelShape
from llmso_lab.sim import kv_pool as kp
from llmso_lab.sim.cost import StepCost

# easy numbers by hand: 1 TFLOP/s peak at 50 % MFU, a 1 GB/s link with 10 us latency
ACC = Accelerator("hand", 1e12, 1e12, 0, "none", 0, 0, 1)
TINY = ModelShape("tiny", 2, 64, 4, 2, 16, 128, 1000)
COST = StepCost(ACC, TINY, dtype_bytes=2, compute_efficiency=0.5)
LINK = Link("hand", 1e9, 1e-5)


def test_formulas_by_hand():
    m, F = TINY, 0.5e12
    body = m.body_matmul_params()
    # attention: 2 layers x 4 heads x (16 + 16) x 2 = 512 FLOPs per query-key pair; 100 tokens -> 5050 pairs
    assert m.attention_flops(1) == 512
    assert kp.prefix_flops(COST, 100) == 2 * body * 100 + 512 * 5050
    assert kp.recompute_time(COST, 100) == pytest.approx((2 * body * 100 + 512 * 5050) / F, rel=1e-12)
    # KV per token: 2 (K, V) x 2 layers x 2 heads x 16 x 2 bytes = 256 B; 100 tokens = 25.6 KB at 1 GB/s
    assert kp.fetch_time(COST, 100, LINK, 1e-3) == pytest.approx(1e-3 + 1e-5 + 25600 / 1e9, rel=1e-12)
    assert kp.fetch_time(COST, 0, LINK, 1e-3) == 0.0
    for p, s in [(0, 5), (100, 0), (100, 37), (1, 1)]:
        # the prefix's share of a prefill is the same whatever follows it
        share = COST.work([(p + s, 0)])[0] - COST.work([(s, p)])[0]
        assert kp.prefix_flops(COST, p) == pytest.approx(share, rel=1e-12)
        rec = kp.ttft(COST, p, s, LINK, 1e-3, "recompute")
        fet = kp.ttft(COST, p, s, LINK, 1e-3, "fetch")
        assert rec - fet == pytest.approx(kp.recompute_time(COST, p) - kp.fetch_time(COST, p, LINK, 1e-3), abs=1e-15)


def test_layerwise_pipeline_by_hand():
    # 2 layers; per layer: transfer = 10 us + (256 x 100 / 2) B / 1 GB/s = 22.8 us; suffix compute c per layer.
    # The suffix's layer 1 waits for layer 1's KV: lookup + max over the two-stage pipeline.
    p, s, look = 100, 50, 1e-3
    t = 1e-5 + 12800 / 1e9
    c = COST.work([(s, p)])[0] / 0.5e12 / 2
    expected = look + t + max(t, c) + c
    assert kp.ttft(COST, p, s, LINK, look, "fetch_layerwise") == pytest.approx(expected, rel=1e-12)
    assert kp.ttft(COST, p, s, LINK, look, "fetch_layerwise") <= kp.ttft(COST, p, s, LINK, look, "fetch") + 1e-5


def test_lecture_number():
    # 8K tokens of Llama-3-70B's KV (2.6 GB) over 400 Gb/s: ~50 ms, plus the lookup
    cost = StepCost(ACCELERATORS["H100-SXM"], LLAMA3_70B, compute_efficiency=0.5)
    assert kp.fetch_time(cost, 8192, LINKS["IB-NDR"], 0.0) == pytest.approx(0.0537, rel=0.01)


@pytest.mark.parametrize("shape", [TINY, SMOLLM2_135M, LLAMA3_8B, LLAMA3_70B])
@pytest.mark.parametrize("link", ["IB-NDR", "100GbE", "25GbE"])
@pytest.mark.parametrize("lookup", [0.0, 1e-4, 1e-3])
def test_breakeven_closed_form_equals_search(shape, link, lookup):
    cost = StepCost(ACCELERATORS["H100-SXM"], shape, compute_efficiency=0.5)
    lk = LINKS[link]
    b = kp.breakeven_prefix_tokens(cost, lk, lookup)
    assert b == kp.breakeven_by_search(cost, lk, lookup)
    assert kp.fetch_pays(cost, b, lk, lookup) and (b == 1 or not kp.fetch_pays(cost, b - 1, lk, lookup))
    # the whole-fetch breakeven does not depend on the suffix
    assert kp.fetch_pays(cost, b, lk, lookup, suffix_tokens=500)
    assert b == 1 or not kp.fetch_pays(cost, b - 1, lk, lookup, suffix_tokens=500)


def test_breakeven_by_linear_scan_and_direction():
    # brute force: the first P from 1 up where fetching pays
    cost = StepCost(ACCELERATORS["H100-SXM"], SMOLLM2_135M, compute_efficiency=0.5)
    b = kp.breakeven_prefix_tokens(cost, LINKS["IB-NDR"], 1e-4)
    first = next(p for p in range(1, 10 * b) if kp.fetch_pays(cost, p, LINKS["IB-NDR"], 1e-4))
    assert first == b and b > 100   # a tiny model with 3 KV heads: the prefix must be long
    # a bigger model pays sooner; a slower link or a slower lookup later
    big = StepCost(ACCELERATORS["H100-SXM"], LLAMA3_8B, compute_efficiency=0.5)
    assert kp.breakeven_prefix_tokens(big, LINKS["IB-NDR"], 1e-4) < b
    assert kp.breakeven_prefix_tokens(cost, LINKS["100GbE"], 1e-4) > b
    assert kp.breakeven_prefix_tokens(cost, LINKS["IB-NDR"], 1e-3) > b
    # layer-wise: search only; it is a real crossover
    bl = kp.breakeven_by_search(cost, LINKS["IB-NDR"], 1e-4, suffix_tokens=256, layerwise=True)
    assert kp.fetch_pays(cost, bl, LINKS["IB-NDR"], 1e-4, 256, True)
    assert not kp.fetch_pays(cost, bl - 1, LINKS["IB-NDR"], 1e-4, 256, True)


def lru_by_definition(trace, doc_tokens, capacity):
    """Brute force LRU: a request hits iff its doc is among the most recently used distinct docs (oversized docs
    skipped) taken newest first while their tokens still fit the capacity."""
    hits = []
    for i, d in enumerate(trace):
        recent, seen, used, cached = [], set(), 0, set()
        for e in reversed(trace[:i]):
            if e not in seen and doc_tokens[e] <= capacity:
                seen.add(e)
                recent.append(e)
        for e in recent:
            if used + doc_tokens[e] > capacity:
                break
            used += doc_tokens[e]
            cached.add(e)
        hits.append(d in cached)
    return hits


def test_lru_against_brute_force():
    rng = np.random.default_rng(1)
    for trial in range(30):
        n_docs = int(rng.integers(2, 8))
        tokens = rng.integers(1, 6, size=n_docs).tolist()
        trace = rng.integers(0, n_docs, size=40).tolist()
        cap = int(rng.integers(0, 12))
        assert kp.replay_hits(trace, tokens, 1, cap, shared=True) == lru_by_definition(trace, tokens, cap), trial
    # private caches: replica r sees requests r, r + R, ...
    tokens, trace = [2, 3, 1, 4, 2], rng.integers(0, 5, size=60).tolist()
    got = kp.replay_hits(trace, tokens, 3, 9, shared=False)
    for r in range(3):
        assert got[r::3] == lru_by_definition(trace[r::3], tokens, 3)
    # a doc bigger than the cache passes through without evicting anything
    c = kp.LRUTokenCache(5)
    assert not c.access(0, 3) and not c.access(1, 9) and c.access(0, 3) and 1 not in c and c.used == 3


def test_shared_pool_beats_private_caches_and_che():
    cost = StepCost(ACCELERATORS["H100-SXM"], LLAMA3_8B, compute_efficiency=0.5)
    docs = np.random.default_rng(0).integers(500, 4000, size=200).tolist()
    prev = None
    for r in (1, 2, 4, 8):
        out = kp.pool_vs_private(cost, LINKS["IB-NDR"], 1e-3, docs, r, 100_000, num_requests=20000)
        assert out.shared_hit_rate >= out.private_hit_rate
        assert abs(out.shared_che - out.shared_hit_rate) < 0.03 and abs(out.private_che - out.private_hit_rate) < 0.03
        if r == 1:
            assert out.shared_hit_rate == out.private_hit_rate
            assert out.shared_ttft_saved_s < out.private_ttft_saved_s   # same hits, but a pool hit pays the fetch
        else:
            assert out.private_hit_rate < prev   # duplicates shrink what R private caches reach
        prev = out.private_hit_rate
    assert out.shared_ttft_saved_s > out.private_ttft_saved_s
    # Che: the whole working set fits -> 1; more capacity never lowers the hit rate
    pop = np.full(4, 0.25)
    assert kp.che_hit_rate(pop, [1, 1, 1, 1], 4) == 1.0
    rates = [kp.che_hit_rate(pop, [1, 2, 3, 4], c) for c in (1, 3, 6, 9)]
    assert rates == sorted(rates) and 0 < rates[0] < rates[-1] < 1


def test_bad_inputs_say_what_to_do():
    with pytest.raises(ValueError, match="int >= 0"):
        kp.recompute_time(COST, -1)
    with pytest.raises(ValueError, match="lookup_latency_s"):
        kp.fetch_time(COST, 10, LINK, -1.0)
    with pytest.raises(ValueError, match="mode must be one of"):
        kp.ttft(COST, 10, 10, LINK, 0.0, "cached")
    with pytest.raises(ValueError, match="num_replicas"):
        kp.replay_hits([0], [1], 0, 10, shared=True)
    with pytest.raises(ValueError, match="doc_tokens for every doc"):
        kp.replay_hits([3], [1], 1, 10, shared=True)
    with pytest.raises(ValueError, match="probability vector"):
        kp.che_hit_rate([0.5, 0.6], [1, 1], 1)
