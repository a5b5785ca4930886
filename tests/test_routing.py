"""Routers (llmso_lab.routing), the simulated cluster (llmso_lab.sim.cluster) and `bench routing` on real engines."""
from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from llmso_lab.routing import ROUTERS, PrefixAware, make_router, prefix_key
from llmso_lab.sim.cluster import ClusterConfig, simulate_cluster
from llmso_lab.sim.cost import UnitCost
from llmso_lab.workloads import SharedPrefixRequest, shared_prefix_workload


def test_prefix_key_reads_the_leading_blocks():
    base = list(range(100, 164))                        # 4 blocks of 16
    assert prefix_key(base + [1, 2, 3]) == prefix_key(base + [9] * 40)   # differs after the 4 blocks: same key
    assert prefix_key([7] + base[1:]) != prefix_key(base)
    assert prefix_key(base[:20] + [1]) == prefix_key(base[:20] + [2])      # one full block, then the tail is ignored
    assert prefix_key([1, 2, 3]) != prefix_key([1, 2, 4])                  # shorter than a block: the whole prompt
    assert prefix_key(base, block_size=32, num_blocks=1) == prefix_key(base[:32] + [5], block_size=32, num_blocks=1)
    with pytest.raises(ValueError, match="at least one token"):
        prefix_key([])


@pytest.mark.parametrize("name", ROUTERS)
def test_routers_are_deterministic(name):
    rng = random.Random(0)
    calls = [(rng.getrandbits(64), [rng.randrange(5) for _ in range(4)]) for _ in range(200)]
    a, b = make_router(name, 4), make_router(name, 4)
    assert [a.route(k, l) for k, l in calls] == [b.route(k, l) for k, l in calls]


def test_round_robin_and_least_loaded():
    rr = make_router("round_robin", 3)
    assert [rr.route(0, [9, 0, 0]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    ll = make_router("least_loaded", 4)
    assert ll.route(0, [3, 1, 2, 1]) == 1 and ll.route(0, [0, 0, 0, 0]) == 0 and ll.route(0, [2, 2, 2, 1]) == 3


def test_prefix_aware_same_prefix_same_replica_whatever_the_loads():
    r = make_router("prefix_aware", 4)
    key = prefix_key(list(range(64)))
    home = r.route(key, [0, 0, 0, 0])
    assert all(r.route(key, loads) == home for loads in ([9, 9, 9, 9], [0, 50, 50, 50], [50, 0, 0, 0]))
    rng = random.Random(1)
    counts = [0] * 4
    for _ in range(4000):
        counts[r.route(rng.getrandbits(64), [0] * 4)] += 1
    assert min(counts) > 0.15 * 4000                    # keys spread over every replica


def test_consistent_hashing_moves_keys_only_to_the_new_replica():
    four, five = PrefixAware(4), PrefixAware(5)
    rng = random.Random(2)
    keys = [rng.getrandbits(64) for _ in range(3000)]
    moved = [k for k in keys if four.route(k, [0] * 4) != five.route(k, [0] * 5)]
    assert all(five.route(k, [0] * 5) == 4 for k in moved)
    assert 0.1 < len(moved) / len(keys) < 0.35         # about 1/5 of the keys


@pytest.mark.parametrize("c", [1.0, 1.25, 2.0])
def test_bounded_load_respects_the_bound_at_every_assignment(c):
    """Random arrivals and departures, keys skewed to a few hot prefixes: the replica chosen never holds more than
    ceil(c * mean) requests after taking one; with arrivals only, no replica ever does."""
    n, rng = 5, random.Random(3)
    r = make_router("prefix_aware_bounded", n, c=c)
    hot = [rng.getrandbits(64) for _ in range(3)]
    for departures in (False, True):
        loads = [0] * n
        for _ in range(2000):
            if departures and sum(loads) and rng.random() < 0.45:
                loads[rng.choice([i for i in range(n) if loads[i]])] -= 1
                continue
            i = r.route(rng.choice(hot), loads)
            loads[i] += 1
            assert loads[i] <= math.ceil(c * sum(loads) / n)
            if not departures:
                assert max(loads) <= math.ceil(c * sum(loads) / n)


def test_bounded_load_keeps_affinity_below_the_bound():
    key = prefix_key(list(range(64)))
    plain, bounded, loose = (make_router("prefix_aware", 4), make_router("prefix_aware_bounded", 4, c=1.5),
                             make_router("prefix_aware_bounded", 4, c=1e9))
    home = plain.route(key, [0] * 4)
    assert bounded.route(key, [0] * 4) == home                   # under the bound: the key's home
    loads = [0] * 4
    loads[home] = 3                                              # ceil(1.5 * 4 / 4) = 2 < 4: over the bound
    assert bounded.route(key, loads) != home
    assert loose.route(key, loads) == home                       # c -> infinity: plain prefix affinity


@pytest.mark.parametrize("call,match", [
    (lambda: make_router("random", 4), "unknown router"),
    (lambda: make_router("round_robin", 0), "num_replicas"),
    (lambda: make_router("prefix_aware_bounded", 4, c=0.9), "c must be >= 1"),
    (lambda: make_router("least_loaded", 4).route(0, [0, 0]), "one load per replica"),
    (lambda: make_router("least_loaded", 2).route(0, [0, -1]), ">= 0"),
])
def test_router_errors_say_what_to_do(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- the simulated cluster ---------------------------------------------------------------------------------
def _req(i, t, prefix_id, prefix_len=32, prompt_len=40, output_len=3):
    return SharedPrefixRequest(i, t, prompt_len, output_len, prefix_id=prefix_id, prefix_len=prefix_len)


def test_cluster_hits_only_a_computed_prefix():
    # 16 tokens a step: request 0 computes its 32-token prefix over steps 1-2; request 1 is admitted at t = 1
    cfg = ClusterConfig(num_replicas=1, max_num_seqs=4, max_num_batched_tokens=16, kv_capacity_tokens=1000)
    reqs = [_req(0, 0.0, 7), _req(1, 0.5, 7), _req(2, 20.0, 7), _req(3, 20.0, 8)]
    res = simulate_cluster(reqs, make_router("round_robin", 1), UnitCost(1.0), cfg)
    assert res.cached_tokens == [0, 0, 32, 0]            # 1 came while prefix 7 was still being computed: a miss
    assert all(m.arrival_time <= m.first_token_time <= m.finish_time for m in res.requests)
    assert res.summary()["hit_rate"] == pytest.approx(32 / 160)


def test_cluster_evicts_the_least_recently_used_unused_prefix():
    # room for a running request (43 tokens) plus one more cached 32-token prefix, not two
    cfg = ClusterConfig(num_replicas=1, max_num_seqs=1, max_num_batched_tokens=64, kv_capacity_tokens=60)
    reqs = [_req(0, 0.0, 1), _req(1, 10.0, 2), _req(2, 20.0, 1), _req(3, 30.0, 1)]
    res = simulate_cluster(reqs, make_router("round_robin", 1), UnitCost(1.0), cfg)
    assert res.cached_tokens == [0, 0, 0, 32]            # prefix 1 evicted for prefix 2, cached again, then hit


def test_cluster_rejects_what_cannot_fit():
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        simulate_cluster([_req(0, 0.0, 1, prompt_len=90, output_len=20)], make_router("round_robin", 1), UnitCost(),
                         ClusterConfig(num_replicas=1, kv_capacity_tokens=100))
    with pytest.raises(ValueError, match="replicas"):
        simulate_cluster([_req(0, 0.0, 1)], make_router("round_robin", 2), UnitCost(), ClusterConfig(num_replicas=3))


def test_cluster_shows_the_lecture_points():
    """Round-robin wastes the caches; pure prefix affinity overloads the replica of the hot prefix; a load bound
    keeps most of the hits and the balance (the figures `bench routing` reports, on a smaller cluster)."""
    from llmso_lab.bench.routing import sim_cost

    cost = sim_cost()
    cfg = ClusterConfig(num_replicas=8, kv_capacity_tokens=cost.kv_capacity_tokens(0.9))
    reqs = shared_prefix_workload(1200, 128, rate=12.0, zipf_s=1.0, seed=0)
    out = {name: simulate_cluster(reqs, make_router(name, 8), cost, cfg).summary() for name in ROUTERS}
    rr, ll, pa, pb = (out[n] for n in ROUTERS)
    assert pa["hit_rate"] > 1.5 * rr["hit_rate"] and pb["hit_rate"] > 1.3 * rr["hit_rate"]
    assert pa["load_imbalance"] > 1.8 and pb["load_imbalance"] < 1.3 and rr["load_imbalance"] < 1.05
    assert pa["ttft_p99_s"] > 2 * pb["ttft_p99_s"]


# ---- real engines ---------------------------------------------------------------------------------------------
def _fake_timer(step=1e-3):
    counter = itertools.count()
    return lambda: next(counter) * step


def test_engine_cluster_routes_and_caches_deterministically():
    from llmso_lab.bench.routing import engine_cluster, engine_workload
    from llmso_lab.models import tiny_llama

    model = tiny_llama()
    prompts, picks = engine_workload(16, 3, 64, (4, 8), 256, seed=0)
    arrivals = [0.05 * j for j in range(16)]
    kw = dict(block_size=16, num_kv_blocks=32, max_num_seqs=2, max_model_len=128)
    runs = {name: engine_cluster(model, make_router(name, 2), prompts, arrivals, 3, timer=_fake_timer(), **kw)
            for name in ("round_robin", "prefix_aware")}
    pa = runs["prefix_aware"]
    for k in set(picks):                                    # a system prompt lives on one replica
        assert len({pa["replica"][j] for j in range(16) if picks[j] == k}) == 1
    assert pa["hit_rate"] > runs["round_robin"]["hit_rate"]
    assert runs["round_robin"]["replica"] == [j % 2 for j in range(16)]
    again = engine_cluster(model, make_router("prefix_aware", 2), prompts, arrivals, 3, timer=_fake_timer(), **kw)
    assert again["replica"] == pa["replica"] and again["ttft_p99_s"] == pa["ttft_p99_s"]
    assert all(len(o.outputs[0].token_ids) == 3 and o.metrics.ttft > 0 for o in pa["outputs"])


def test_step_work_reads_what_the_engine_computed():
    from llmso_lab.bench.routing import step_work
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.models import tiny_llama

    llm = LLM(tiny_llama(), block_size=8, max_num_seqs=2, max_model_len=64, enable_prefix_caching=True)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.add_request(list(range(10, 30)), sp)
    assert step_work(llm, llm.step()[1]) == ([(20, 0)], [])
    assert step_work(llm, llm.step()[1]) == ([], [21])
    llm.step()                                                   # retires the first request
    llm.add_request(list(range(10, 26)) + [5, 6, 7], sp)         # its first 2 blocks are cached
    assert step_work(llm, llm.step()[1]) == ([(3, 16)], [])


def test_engine_cluster_with_a_cost_model():
    """Modelled step times: a deterministic timeline; prefix affinity hits more and piles up on one replica."""
    from llmso_lab.bench.routing import engine_cluster, engine_workload, sim_cost
    from llmso_lab.models import tiny_llama

    model = tiny_llama()
    prompts, _ = engine_workload(24, 4, 128, (4, 8), 256, zipf_s=1.5, seed=0)
    arrivals = [0.02 * j for j in range(24)]
    kw = dict(block_size=16, num_kv_blocks=48, max_num_seqs=2, max_model_len=192)
    runs = {name: engine_cluster(model, make_router(name, 2), prompts, arrivals, 2, sim_cost(), **kw)
            for name in ("round_robin", "prefix_aware")}
    rr, pa = runs["round_robin"], runs["prefix_aware"]
    assert pa["hit_rate"] > rr["hit_rate"] and pa["load_imbalance"] > rr["load_imbalance"]
    step = sim_cost().step_time(decode=[1])                      # no step is shorter than one weight read
    assert all(t >= step for t in rr["ttft"] + pa["ttft"])
    again = engine_cluster(model, make_router("prefix_aware", 2), prompts, arrivals, 2, sim_cost(), **kw)
    assert again["ttft"] == pa["ttft"]


def test_bench_routing_quick_structure():
    from llmso_lab.bench.routing import run

    res = run(quick=True, engine=dict(num_replicas=2, num_requests=12, num_prefixes=3, prefix_len=64, num_kv_blocks=48,
                                      max_model_len=128),
              sim=dict(num_replicas=4, num_requests=200, num_prefixes=16, rates=(6.0,)))
    assert [(r["experiment"], r["router"]) for r in res["table"]] == \
        [("engines x2", n) for n in ROUTERS] + [("sim x4 @6/s", n) for n in ROUTERS]
    assert all({"hit_rate", "ttft_p50_s", "ttft_p99_s", "load_imbalance"} <= set(r) for r in res["table"])
    assert all(0 <= r["hit_rate"] <= 1 and r["load_imbalance"] >= 1 for r in res["table"])
    assert "sim_6rps_hit_rate_prefix_aware_over_round_robin" in res["ratios"]
    assert "engines_load_imbalance_bounded" in res["ratios"]
    json.dumps(res)


def test_ring_bounded_pick_is_the_bounded_routers_decision_and_route_stream_bounds_the_load():
    """Lab 04's ring walk makes the same choice as `PrefixAwareBounded` (which walks `candidates`), and a stream routed
    through it never puts more than ceil(c * mean) requests on a replica, while pure affinity does."""
    import random

    from llmso_lab.routing import PrefixAware, PrefixAwareBounded, ring_bounded_pick, route_stream, stable_hash

    rng = random.Random(3)
    router = PrefixAwareBounded(6, c=1.25, vnodes=16)
    ring = list(zip(router.points, router.owners))
    for key in [rng.getrandbits(64) for _ in range(300)] + router.points[:5] + [0, 2**64 - 1]:
        loads = [rng.randint(0, 9) for _ in range(6)]
        assert ring_bounded_pick(ring, key, loads, 1.25) == router.route(key, loads)
    keys = [stable_hash(f"p{min(int(rng.paretovariate(1.0)), 30)}".encode()) for _ in range(400)]
    bounded = route_stream(ring_bounded_pick, 6, keys, 1.25, hold=60)
    home = route_stream(lambda r, k, loads, c: next(PrefixAware(6, 16).candidates(k)), 6, keys, 1.25, hold=60)
    assert bounded["peak_load"] <= -(-1.25 * 60 // 6) < home["peak_load"]
    assert home["home_share"] == 1.0 > bounded["home_share"] > 0.3
    with pytest.raises(ValueError, match="replica index"):
        route_stream(lambda *a: 7, 6, keys[:3], 1.25, hold=2)
