"""PD-disaggregation planning in the simulator (lecture 2-3): the capacity argument against brute force, the TP
instance cost against `sim.comm`'s TP model, the event model on hand-checkable cases and against independent
step-by-step references, the lecture's 2.6 GB / ~50 ms figure, PD vs colocated, the autoscaler, and the
calibrated 1P:1D prediction."""
import math
import random
from fractions import Fraction

import pytest

from llmso_lab.disagg.transfer import exposed_transfer_time, kv_transfer_bytes
from llmso_lab.hardware import ACCELERATORS, LINKS, Accelerator, Link
from llmso_lab.models.shapes import DEEPSEEK_V2, LLAMA3_70B, SMOLLM2_135M, ModelShape
from llmso_lab.sim import comm
from llmso_lab.sim.cluster import ClusterConfig, _Replica, _Req
from llmso_lab.sim.comm import Layout, Topology, TPCost
from llmso_lab.sim.cost import StepCost
from llmso_lab.sim.disagg import (Autoscaler, _Decoder, _State, best_pd_ratio, fixed_workload, pd_capacity,
                                  simulate_colocated, simulate_pd)
from llmso_lab.sim.disagg_plan import (calibrated_cost, capacity_plan, h100_instance, instance_rates, link_table,
                                       plan_pd, predict_disaggregated)
from llmso_lab.workloads import Request, SharedPrefixRequest

H100 = ACCELERATORS["H100-SXM"]
IB = LINKS["IB-NDR"]
TP4 = h100_instance(4)


# ---- the capacity argument ------------------------------------------------------------------------------------
def brute_force_ratio(n, inp, out, pre, dec):
    """Every split, exact arithmetic; the best capacity, fewest prefill instances on a tie."""
    caps = {x: min(Fraction(x) * pre / inp, Fraction(n - x) * dec / out) for x in range(1, n)}
    best = max(caps.values())
    x = min(x for x, c in caps.items() if c == best)
    return x, n - x


def test_best_pd_ratio_matches_brute_force_including_ties():
    rng = random.Random(0)
    ties = 0
    for _ in range(400):
        n, inp, out = rng.randint(2, 12), rng.choice([100, 200, 4000]), rng.choice([100, 2000])
        # whole requests/s per instance: capacities are exact in floats, so ties are real ties
        pre, dec = inp * rng.randint(1, 6), out * rng.randint(1, 6)
        caps = [min(x * pre / inp, (n - x) * dec / out) for x in range(1, n)]
        ties += caps.count(max(caps)) > 1
        assert best_pd_ratio(n, inp, out, pre, dec) == brute_force_ratio(n, inp, out, pre, dec)
    assert ties > 20                                   # the tie rule was exercised
    assert best_pd_ratio(8, 4000, 100, 12_000, 3_600) == (7, 1)   # lecture: thick prefill
    assert best_pd_ratio(8, 200, 2000, 12_000, 8_000) == (1, 7)   # thick decode
    assert pd_capacity(7, 1, 4000, 100, 12_000, 3_600) == pytest.approx(21.0)


@pytest.mark.parametrize("bad", [1, 0, -3, 2.0, "4"])
def test_best_pd_ratio_rejects_fewer_than_two_instances(bad):
    with pytest.raises(ValueError, match="total_instances"):
        best_pd_ratio(bad, 100, 100, 1.0, 1.0)


def test_pd_capacity_rejects_bad_lengths_and_rates():
    for args in [(0, 100, 1.0, 1.0), (100, 0, 1.0, 1.0), (100, 100, 0.0, 1.0), (100, 100, 1.0, -1.0)]:
        with pytest.raises(ValueError, match="> 0"):
            pd_capacity(1, 1, *args)


def test_capacity_plan_gives_the_lectures_shapes():
    """From the roofline of TP4 H100 instances of Llama-3-70B: 4000/100 wants more prefill, 200/2000 more decode."""
    a, b = capacity_plan(4000, 100, 8), capacity_plan(200, 2000, 8)
    assert a["x"] > a["y"] and b["y"] > b["x"]
    pre, dec = instance_rates(TP4, TP4, 4000, 100)
    assert (a["x"], a["y"]) == best_pd_ratio(8, 4000, 100, pre, dec)
    assert a["capacity_rps"] == pytest.approx(pd_capacity(a["x"], a["y"], 4000, 100, pre, dec))


# ---- a TP group's step cost -----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,tp", [(LLAMA3_70B, 1), (LLAMA3_70B, 2), (LLAMA3_70B, 4), (LLAMA3_70B, 8),
                                      (LLAMA3_70B, 16),            # more ranks than KV heads: KV replicated
                                      (DEEPSEEK_V2, 1), (DEEPSEEK_V2, 8)])   # MoE + MLA
def test_tp_cost_equals_comms_shard_model(shape, tp):
    cost = StepCost(H100, shape, 2, None, 0.5, 0.8, 0.002)
    inst = TPCost(cost, tp)
    rng = random.Random(tp)
    topo, layout = Topology(tp, 1, inst.link, inst.link), Layout(tp=tp)
    for _ in range(20):
        prefill = [(rng.randint(1, 900), rng.randint(0, 3000)) for _ in range(rng.randint(0, 3))]
        decode = [rng.randint(1, 5000) for _ in range(rng.randint(0, 40))]
        if not prefill and not decode:
            assert inst.step_time() == 0.0
            continue
        compute, tp_comm = comm._shard_cost(cost, layout, prefill, decode, 2, topo)
        assert inst.step_time(prefill, decode) == pytest.approx(compute + tp_comm, rel=1e-12)
        if decode:
            assert inst.decode_time(len(decode), sum(decode)) == pytest.approx(inst.step_time((), decode), rel=1e-12)
    if tp == 1:
        assert inst.step_time([(300, 20)], [100, 200]) == pytest.approx(cost.step_time([(300, 20)], [100, 200]), rel=1e-12)


def test_tp_cost_matches_public_decode_and_prefill_steps():
    topo, layout = Topology(4, 1, TP4.link, TP4.link), Layout(tp=4)
    assert TP4.step_time((), [1000] * 8) == pytest.approx(comm.decode_step(TP4.cost, topo, layout, 8, 1000).time_s, rel=1e-12)
    assert TP4.step_time([(500, 0)] * 2) == pytest.approx(comm.prefill_step(TP4.cost, topo, layout, 2, 500).time_s, rel=1e-12)


def test_tp_cost_kv_capacity():
    # 4 ranks, each 72 GB usable minus a quarter of the weights, over a quarter of each token's KV
    per_rank = 80e9 * 0.9 - LLAMA3_70B.weight_bytes(2) / 4
    assert TP4.kv_capacity_tokens() == math.floor(per_rank / (LLAMA3_70B.kv_bytes_per_token(2) / 4))
    with pytest.raises(ValueError, match="larger tp"):
        h100_instance(1).kv_capacity_tokens()            # 141 GB of weights on one 80 GB GPU
    with pytest.raises(ValueError):
        TPCost(TP4.cost, 3)                              # 64 heads / 8 KV heads do not split 3 ways


# ---- the event model: hand-checkable cases --------------------------------------------------------------------
@pytest.mark.parametrize("layerwise", [True, False])
def test_one_request_ttft_is_prefill_plus_exposed_transfer_and_tpot_is_the_step_time(layerwise):
    p, out = 4000, 6
    res = simulate_pd([Request(0, 1.5, p, out)], 1, 1, TP4, TP4, IB, layerwise=layerwise)
    m, ph = res.requests[0], res.phases
    prefill = TP4.step_time([(p, 0)])
    nbytes, bw = p * LLAMA3_70B.kv_bytes_per_token(2), IB.bandwidth * 4       # 4 rank pairs send in parallel
    if layerwise:
        exposed = exposed_transfer_time([prefill / 80] * 80, [IB.latency + nbytes / 80 / bw] * 80)
        assert exposed == pytest.approx(IB.latency + nbytes / 80 / bw)       # only the last layer shows
    else:
        exposed = IB.latency + nbytes / bw
    assert m.ttft == pytest.approx(prefill + exposed, rel=1e-12)
    assert (ph["queue_s"][0], ph["prefill_s"][0], ph["transfer_s"][0]) == pytest.approx((0, prefill, exposed), rel=1e-12)
    assert ph["decode_wait_s"][0] == 0.0
    steps = [TP4.step_time((), [p + j]) for j in range(1, out)]                # contexts p+1 .. p+out-1
    assert m.tpot == pytest.approx(sum(steps) / (out - 1), rel=1e-12)
    assert m.finish_time == pytest.approx(1.5 + prefill + exposed + sum(steps), rel=1e-12)


def test_transfers_from_one_prefill_instance_share_its_nics():
    """Two prompts prefilled in one step, sent whole: the second waits for the first on the same links. (A step
    starts as soon as there is work: request 0 runs alone, 1 and 2 arrive during its step and run together.)"""
    reqs = [Request(0, 0.0, 100, 4), Request(1, 0.001, 1000, 4), Request(2, 0.001, 1000, 4)]
    res = simulate_pd(reqs, 1, 2, TP4, TP4, IB, layerwise=False)
    one = IB.latency + 1000 * LLAMA3_70B.kv_bytes_per_token(2) / (4 * IB.bandwidth)
    assert res.phases["prefill_s"][1:] == pytest.approx([TP4.step_time([(1000, 0)] * 2)] * 2, rel=1e-12)
    assert res.phases["transfer_s"][1:] == pytest.approx([one, 2 * one], rel=1e-9)


def test_lecture_8k_prompt_is_2_6_GB_and_about_50_ms_over_400_Gbps():
    cfg = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192}
    nbytes = kv_transfer_bytes(cfg, 8192)
    assert nbytes == LLAMA3_70B.kv_cache_bytes(8192) == 8192 * 327_680                # 320 KiB per token
    assert nbytes / 1e9 == pytest.approx(2.68, abs=0.005)                               # "약 2.6GB"
    t = comm.kv_transfer_time(LLAMA3_70B, 8192, IB)
    assert IB.bandwidth == 50e9 and t == pytest.approx(0.0537, abs=5e-4)        # "50 ms 남짓"
    row = next(r for r in link_table((8192,), ("IB-NDR",)) if r["prompt_len"] == 8192)
    assert row["transfer_s"] == row["exposed_whole_s"] == pytest.approx(t, rel=1e-12)
    assert 0.2 < row["prefill_s"] < 1.0 and row["exposed_layerwise_s"] < row["transfer_s"] / 50   # hidden
    # the event model moves the same bytes: one stream, sent whole
    one = StepCost(H100, LLAMA3_70B, 2, None, 0.5, 0.8, 0.002)
    res = simulate_pd([Request(0, 0.0, 8192, 2)], 1, 1, one, one, IB, layerwise=False,
                      kv_capacity_tokens=(10_000, 10_000))
    assert res.phases["transfer_s"][0] == pytest.approx(t, rel=1e-12)


def test_link_table_slower_links_expose_more():
    rows = link_table((128, 8192), ("NVLink4", "IB-NDR", "100GbE", "25GbE"))
    for p in (128, 8192):
        by = [r for r in rows if r["prompt_len"] == p]
        assert [r["transfer_s"] for r in by] == sorted(r["transfer_s"] for r in by)
        assert all(r["exposed_layerwise_s"] <= r["exposed_whole_s"] for r in by)
    slow = next(r for r in rows if r["link"] == "25GbE" and r["prompt_len"] == 8192)
    assert slow["exposed_layerwise_s"] > 0.1 * slow["prefill_s"]        # a link slower than the compute: backlog


# ---- the event model against independent references -----------------------------------------------------------
def test_decoder_makes_the_cluster_replicas_decisions():
    """`_Decoder` (running totals) against `cluster`'s replica with decode-only requests (lists), step by step."""
    cfg = ClusterConfig(1, max_num_seqs=3, max_num_batched_tokens=3, kv_capacity_tokens=600)
    rng = random.Random(1)
    reqs = [Request(i, 0.0, rng.randint(10, 200), rng.randint(2, 30)) for i in range(12)]
    dec, rep = _Decoder(cfg, TP4), _Replica(cfg, TP4)
    states = {r.request_id: _State(r) for r in reqs}
    finish_a, finish_b, now = {}, {}, 0.0
    for r in reqs:
        dec.waiting.append(states[r.request_id])
        rep.waiting.append(_Req(SharedPrefixRequest(r.request_id, 0.0, r.prompt_len, r.output_len), 0,
                                computed=r.prompt_len, generated=1))
    while True:
        dec.start_step(now)
        rep.start_step(now)
        if dec.step_end is None:
            assert rep.step_end is None
            break
        assert dec.step_end == pytest.approx(rep.step_end, rel=1e-12)
        now = rep.step_end
        finish_a.update({s.req.request_id: now for s in dec.end_step()})
        finish_b.update({q.req.request_id: now for q in rep.end_step()})
    assert finish_a == finish_b and len(finish_a) == len(reqs)


class LinearCost:
    """A cost model with no model shape: 10 ms a step + 1 us per prompt token + 0.1 us per decode context token."""

    def step_time(self, prefill=(), decode=()):
        if not prefill and not decode:
            return 0.0
        return 0.01 + 1e-6 * sum(n for n, _ in prefill) + 1e-7 * sum(decode)

    def swap_time(self, n):
        return 0.0

    def kv_capacity_tokens(self, gpu_memory_utilization=0.9):
        return None


def reference_decode_pool(landed, max_num_seqs, kv_capacity, cost):
    """Brute force: one decode instance, step by step, contexts as a list. landed: (time, request)."""
    waiting = sorted(landed, key=lambda x: x[0])
    running, now, used, finish = [], 0.0, 0, {}
    while waiting or running:
        queue = [w for w in waiting if w[0] <= now]
        for t, r in queue:                                  # FCFS admission at the step's start
            need = r.prompt_len + r.output_len
            if len(running) == max_num_seqs or used + need > kv_capacity:
                break
            waiting.remove((t, r))
            running.append([r, 1])
            used += need
        if not running:
            now = waiting[0][0]
            continue
        now += cost.step_time((), [r.prompt_len + g for r, g in running])
        for item in list(running):
            item[1] += 1
            if item[1] == item[0].output_len:
                running.remove(item)
                used -= item[0].prompt_len + item[0].output_len
                finish[item[0].request_id] = now
    return finish


def test_one_decode_instance_matches_a_step_by_step_reference():
    reqs = fixed_workload(30, 40.0, 300, 25, seed=3) + fixed_workload(10, 40.0, 120, 60, seed=4, first_id=30)
    res = simulate_pd(reqs, 2, 1, LinearCost(), LinearCost(), Link("lan", 1e9, 1e-4), max_num_seqs=4,
                      kv_capacity_tokens=(None, 1000), kv_bytes_per_token=1000, num_layers=4)
    landed = [(m.first_token_time, r) for m, r in zip(res.requests, reqs)]
    ref = reference_decode_pool(landed, 4, 1000, LinearCost())
    assert {m.request_id: m.finish_time for m in res.requests} == pytest.approx(ref, rel=1e-12)
    assert max(res.phases["decode_wait_s"]) > 0                  # the slots and the KV limit did bind


def test_conservation_and_ttft_split():
    reqs = fixed_workload(60, 6.0, 4000, 50, seed=0) + [Request(60, 1.0, 700, 1)]   # one-token answer: no transfer
    res = simulate_pd(reqs, 2, 1, TP4, TP4, IB)
    assert [m.request_id for m in res.requests] == [r.request_id for r in reqs]
    assert all(math.isfinite(m.finish_time) and m.finish_time >= m.first_token_time > m.arrival_time
               for m in res.requests)
    split = [sum(v) for v in zip(res.phases["queue_s"], res.phases["prefill_s"], res.phases["transfer_s"])]
    assert split == pytest.approx([m.ttft for m in res.requests], rel=1e-9)
    assert res.phases["transfer_s"][-1] == 0.0 and res.requests[-1].finish_time == res.requests[-1].first_token_time
    tl = res.timeline
    assert len({len(v) for v in tl.values()}) == 1 and tl["t"] == sorted(tl["t"])
    assert set(tl["num_prefill"]) == {2} and set(tl["num_decode"]) == {1}
    s = res.summary()
    assert 0 < s["util_prefill"] <= 1 and 0 < s["util_decode"] <= 1
    assert s["goodput"] == pytest.approx(sum(res.meets_slo()) / (reqs[59].arrival_time - reqs[0].arrival_time))


def test_more_decode_instances_never_lower_decode_throughput():
    reqs = fixed_workload(48, math.inf, 200, 300)                   # an offline batch, decode-bound
    tput = [simulate_pd(reqs, 1, y, TP4, TP4, IB, max_num_seqs=8).summary()["output_tokens_per_s"]
            for y in range(1, 5)]
    assert tput == sorted(tput) and tput[-1] > 2.5 * tput[0]


def test_layerwise_never_exposes_more_than_whole():
    reqs = fixed_workload(20, 4.0, 3000, 20, seed=5)
    slow = LINKS["25GbE"]
    a = simulate_pd(reqs, 2, 1, TP4, TP4, slow, layerwise=True)
    b = simulate_pd(reqs, 2, 1, TP4, TP4, slow, layerwise=False)
    assert all(x <= y + 1e-12 for x, y in zip(a.phases["transfer_s"], b.phases["transfer_s"]))
    assert sum(a.phases["transfer_s"]) < 0.5 * sum(b.phases["transfer_s"])


def test_bad_inputs_raise_clear_errors():
    r = [Request(0, 0.0, 100, 10)]
    with pytest.raises(ValueError, match="num_prefill"):
        simulate_pd(r, 0, 1, TP4, TP4)
    with pytest.raises(ValueError, match="hardware.Link"):
        simulate_pd(r, 1, 1, TP4, TP4, "IB-NDR")
    with pytest.raises(ValueError, match="does not fit"):
        simulate_pd(r, 1, 1, TP4, TP4, kv_capacity_tokens=(None, 50))
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        simulate_pd(r, 1, 1, LinearCost(), LinearCost())
    with pytest.raises(ValueError, match="same tp"):
        simulate_pd(r, 1, 1, TP4, h100_instance(8), autoscaler=Autoscaler())
    with pytest.raises(ValueError, match="empty"):
        simulate_pd([], 1, 1, TP4, TP4)
    with pytest.raises(ValueError):
        Autoscaler(interval_s=0)


# ---- PD against colocated, planning, autoscaling ---------------------------------------------------------------
def test_pd_beats_colocated_on_tpot_under_long_prompt_interference():
    reqs = fixed_workload(80, 6.0, 4000, 100, seed=0)            # 16 GPUs: 4 TP4 instances either way
    pd = simulate_pd(reqs, 3, 1, TP4, TP4, IB).summary()
    co = simulate_colocated(reqs, 4, TP4, max_num_batched_tokens=2048).summary()
    assert pd["tpot_p50"] < 0.8 * co["tpot_p50"] and pd["tpot_p99"] < co["tpot_p99"]
    # the decode pool sees no prefill: its TPOT is a plain decode step of its batch
    assert pd["tpot_p99"] < TP4.step_time((), [4100] * 64)


def test_plan_pd_sweeps_the_splits_and_compares_with_colocated():
    reqs = fixed_workload(40, 6.0, 4000, 100, seed=1)
    plan = plan_pd(reqs, 16, colocated_budgets=(512, 2048))
    assert [(r["x"], r["y"]) for r in plan["rows"]] == [(1, 3), (2, 2), (3, 1)]
    assert plan["best"] in plan["rows"] and plan["best"]["goodput"] == max(r["goodput"] for r in plan["rows"])
    assert plan["best"]["x"] == 3                                  # prompts dominate
    assert [r["budget"] for r in plan["colocated"]] == [512, 2048] and all(r["replicas"] == 4 for r in plan["colocated"])
    mixed = plan_pd(reqs, 16, tps=((4, 4), (8, 4)), colocated_budgets=(2048,))
    assert (1, 2) in [(r["x"], r["y"]) for r in mixed["rows"] if r["tp_prefill"] == 8]


def test_autoscaler_moves_capacity_toward_the_bottleneck_pool():
    kw = dict(autoscaler=Autoscaler(interval_s=2.0, switch_delay_s=1.0))
    prompts = simulate_pd(fixed_workload(120, 8.0, 4000, 50, seed=2), 2, 2, TP4, TP4, IB, **kw)
    moves = [s["move"] for s in prompts.scaling if s["move"]]
    assert moves and set(moves) == {"decode -> prefill"} and prompts.timeline["num_prefill"][-1] == 3
    answers = simulate_pd(fixed_workload(150, 25.0, 200, 400, seed=3), 3, 1, TP4, TP4, IB, max_num_seqs=32, **kw)
    moves = [s["move"] for s in answers.scaling if s["move"]]
    assert moves and set(moves) == {"prefill -> decode"} and answers.timeline["num_decode"][-1] > 1
    # the instances are conserved: prefill + decode + switching = 4 at every sample
    assert all(p + d <= 4 for p, d in zip(answers.timeline["num_prefill"], answers.timeline["num_decode"]))
    assert all(math.isfinite(m.finish_time) for m in answers.requests)


# ---- the calibrated 1P:1D prediction ---------------------------------------------------------------------------
CPU = Accelerator("test-cpu", 2e11, 2e10, 0.0, "none", 0.0, 0.0)   # fixed: no measurement in tests


def test_predict_disaggregated_is_simulate_pd_with_one_instance_each():
    cost = StepCost(CPU, SMOLLM2_135M, 4, None, 0.3, 0.5, 0.01, overlap=False)
    reqs = [Request(0, 0.0, 64, 8), Request(1, 0.05, 32, 4)]
    pred = predict_disaggregated(cost, cost, (1e9, 1e-4), reqs)
    ref = simulate_pd(reqs, 1, 1, cost, cost, Link("given", 1e9, 1e-4), layerwise=False, max_num_batched_tokens=512,
                      prefill_max_num_seqs=8, max_num_seqs=8)
    assert pred["ttft_s"] == [m.ttft for m in ref.requests] and pred["tpot_s"] == [m.tpot for m in ref.requests]
    kv = 64 * SMOLLM2_135M.kv_bytes_per_token(4)                   # fp32 KV on the CPU engine
    assert pred["ttft_s"][0] == pytest.approx(cost.step_time([(64, 0)]) + 1e-4 + kv / 1e9, rel=1e-12)


def test_calibrated_cost_from_real_engine_traces_feeds_the_prediction():
    from llmso_lab.engine import LLM
    from llmso_lab.models.tiny import tiny_llama
    from llmso_lab.sim import run_on_engine

    model = tiny_llama()
    shape = ModelShape.from_hf_config(model.config, "tiny")
    llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=64)
    work = [Request(i, 0.0, p, o) for i, (p, o) in enumerate([(40, 6), (12, 4), (60, 3), (8, 8), (30, 5)])]
    run = run_on_engine(llm, work, seed=0)
    cost = calibrated_cost(run.traces, shape, CPU, skip_first=0)
    assert cost.model is shape and cost.overhead_s >= 0 and not cost.overlap
    pred = predict_disaggregated(cost, cost, Link("loopback", 1e9, 5e-5), work, max_num_seqs=4)
    assert all(t > 0 and math.isfinite(t) for t in pred["ttft_s"]) and len(pred["tpot_s"]) == len(work)
    assert pred["summary"]["slo_attainment"] >= 0
