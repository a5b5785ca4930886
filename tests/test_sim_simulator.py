"""Simulator behaviour: the lecture's grid, batching modes, token budget, KV preemption, policies."""
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmso_lab.hardware import ACCELERATORS
from llmso_lab.models.shapes import LLAMA3_70B
from llmso_lab.sim import SimConfig, StepCost, UnitCost, lecture_slot_grids, preemption_costs, simulate
from llmso_lab.sim.grid import lecture_requests
from llmso_lab.workloads import Request, make_workload, mixed_workload

H100 = ACCELERATORS["H100-SXM"]
COST_70B = StepCost(H100, LLAMA3_70B)   # weights alone overflow 80 GB: tests pass num_kv_blocks explicitly
BIG_KV = 100_000


def test_lecture_static_grid_has_12_of_28_cells_empty():
    grid = lecture_slot_grids()["static"]
    assert grid.shape == (4, 7) and grid.size == 28
    assert (grid == -1).sum() == 12
    assert [int((row >= 0).sum()) for row in grid] == [7, 3, 4, 2]


def test_continuous_fills_the_holes_and_finishes_waiting_requests_earlier():
    grids = lecture_slot_grids()
    static, cont = grids["static_all"], grids["continuous"]
    assert (cont == -1).sum() < (static == -1).sum()
    assert cont.shape == (4, 7) and (cont == -1).sum() == 0  # all seven requests in the same 28 cells
    done = {}
    for mode in ("static", "continuous"):
        res = simulate(lecture_requests(), UnitCost(), batching=mode, max_num_seqs=4)
        done[mode] = {r.request_id: r.finish_time for r in res.requests}
    for rid in (4, 5, 6):
        assert done["continuous"][rid] < done["static"][rid]
    assert max(done["continuous"].values()) == 7 and max(done["static"].values()) == 12


@pytest.mark.parametrize("batching", ["static", "dynamic", "continuous"])
def test_every_request_finishes_with_sane_times(batching):
    w = make_workload(40, rate=20.0, prompt_len=(8, 64), output_len=(1, 40), seed=3)
    res = simulate(w, COST_70B, batching=batching, max_num_seqs=8, num_kv_blocks=BIG_KV, batch_window_s=0.05)
    for r, req in zip(res.requests, w):
        assert req.arrival_time <= r.first_token_time <= r.finish_time < math.inf
    assert len(res.steps) > 0 and res.num_preemptions_total == 0


def test_static_rows_return_together_and_pay_for_idle_slots():
    w = [Request(0, 0.0, 10, 2), Request(1, 0.0, 50, 20)]
    res = simulate(w, COST_70B, batching="static", max_num_seqs=2, num_kv_blocks=BIG_KV)
    assert res.requests[0].finish_time == res.requests[1].finish_time   # the short answer waits
    assert len(res.steps) == 20 and all(s.num_decode_seqs == 2 for s in res.steps[1:])  # padded rows computed
    assert res.steps[0].num_prefill_tokens == 2 * 50                      # padded to the longest prompt


def test_continuous_beats_static_on_the_mixed_workload():
    w = mixed_workload(64, seed=0)
    tput = {m: simulate(w, COST_70B, batching=m, max_num_seqs=16, num_kv_blocks=BIG_KV).output_throughput
            for m in ("static", "continuous")}
    assert tput["continuous"] > 1.2 * tput["static"]


def test_dynamic_window_starts_batches_without_waiting_to_fill():
    w = [Request(i, float(i), 16, 8) for i in range(4)]       # one request per second
    static = simulate(w, UnitCost(0.01), batching="static", max_num_seqs=4)
    dynamic = simulate(w, UnitCost(0.01), batching="dynamic", max_num_seqs=4, batch_window_s=0.2)
    assert static.requests[0].ttft == pytest.approx(3.01)     # waits for the 4th arrival
    assert dynamic.requests[0].ttft == pytest.approx(0.21)    # window closes at 0.2 s


def test_chunked_prefill_respects_budget_and_keeps_decodes_running():
    w = [Request(0, 0.0, 32, 64), Request(1, 0.5, 2000, 8)]   # a long prompt joins a running decode
    chunked = simulate(w, COST_70B, max_num_batched_tokens=256, num_kv_blocks=BIG_KV)
    assert all(s.num_batched_tokens <= 256 for s in chunked.steps)
    joined = [s for s in chunked.steps if s.num_prefill_tokens and s.start >= 0.5]
    assert len(joined) >= 8 and all(s.num_decode_seqs == 1 for s in joined[:8])
    whole = simulate(w, COST_70B, max_num_batched_tokens=4096, enable_chunked_prefill=False, num_kv_blocks=BIG_KV)
    stall = max(s.seconds for s in whole.steps)
    assert stall > 3 * max(s.seconds for s in chunked.steps)  # the generation stall chunking removes
    assert whole.requests[1].ttft < chunked.requests[1].ttft   # ... paid for with a later first token
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        simulate(w, COST_70B, max_num_batched_tokens=1024, enable_chunked_prefill=False, num_kv_blocks=BIG_KV)


def test_token_budget_trades_ttft_for_tpot():
    from llmso_lab.models.shapes import LLAMA3_8B
    w = make_workload(60, rate=8.0, prompt_len=(256, 2048), output_len=(16, 128), seed=0)
    run = {b: simulate(w, StepCost(H100, LLAMA3_8B), max_num_seqs=64, max_num_batched_tokens=b).summary()
           for b in (256, 8192)}
    assert run[256]["ttft_s"]["p50"] > run[8192]["ttft_s"]["p50"]   # small budget: prompts wait longer
    assert run[256]["tpot_s"]["p99"] < run[8192]["tpot_s"]["p99"]   # ... but decodes stay smooth


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_kv_budget_preempts_and_still_finishes(mode):
    w = make_workload(12, prompt_len=(16, 48), output_len=(30, 60), seed=1)
    res = simulate(w, COST_70B, max_num_seqs=12, block_size=16, num_kv_blocks=14, preemption_mode=mode)
    assert res.num_preemptions_total > 0
    assert all(r.finish_time < math.inf for r in res.requests)
    assert all(s.num_blocks_used <= 14 for s in res.steps)
    prefilled = sum(s.num_prefill_tokens for s in res.steps)
    if mode == "recompute":
        assert prefilled > sum(r.prompt_len for r in w)       # prompts (and outputs) computed again
    else:
        assert prefilled == sum(r.prompt_len for r in w)      # KV comes back over PCIe instead


def test_swap_pays_pcie_time():
    w = make_workload(12, prompt_len=(16, 48), output_len=(30, 60), seed=1)
    kw = dict(max_num_seqs=12, num_kv_blocks=14, preemption_mode="swap")
    fast = simulate(w, COST_70B, **kw).steps
    slow_link = StepCost(dataclasses.replace(H100, host_bw=1e6), LLAMA3_70B)   # 1 MB/s "PCIe"
    slow = simulate(w, slow_link, **kw).steps
    assert sum(s.seconds for s in slow) > sum(s.seconds for s in fast) + 1.0


def test_validation_errors():
    w = [Request(0, 0.0, 100, 100)]
    with pytest.raises(ValueError, match="num_kv_blocks"):
        simulate(w, COST_70B, num_kv_blocks=5, block_size=16)
    with pytest.raises(ValueError, match="do not fit"):
        simulate(w, COST_70B)
    with pytest.raises(ValueError, match="scheduling_policy"):
        SimConfig(scheduling_policy="lifo")


def test_priority_serves_low_values_first():
    w = [Request(i, 0.0, 16, 4, priority=p) for i, p in enumerate([3, 1, 2, 0])]
    res = simulate(w, UnitCost(), max_num_seqs=1, scheduling_policy="priority")
    order = [r.request_id for r in sorted(res.requests, key=lambda r: r.first_token_time)]
    assert order == [3, 1, 2, 0]
    fcfs = simulate(w, UnitCost(), max_num_seqs=1)
    assert [r.request_id for r in sorted(fcfs.requests, key=lambda r: r.first_token_time)] == [0, 1, 2, 3]


def test_priority_preempts_the_largest_value():
    w = [Request(0, 0.0, 16, 60, priority=0), Request(1, 0.0, 16, 60, priority=5), Request(2, 0.0, 16, 60, priority=1)]
    res = simulate(w, UnitCost(), block_size=16, num_kv_blocks=8, scheduling_policy="priority")
    preempted = {r.request_id: r.num_preemptions for r in res.requests}
    assert preempted[1] > 0 and preempted[0] == 0


def test_sjf_lowers_mean_latency_vs_fcfs():
    w = mixed_workload(48, seed=2)
    mean_e2e = {p: np.mean([r.e2e for r in simulate(w, COST_70B, max_num_seqs=4, num_kv_blocks=BIG_KV,
                                                      scheduling_policy=p).requests]) for p in ("fcfs", "sjf")}
    assert mean_e2e["sjf"] < 0.85 * mean_e2e["fcfs"]


def test_sjf_aging_bounds_the_wait_of_a_long_job():
    shorts = [Request(i, 4.0 * i, 16, 5) for i in range(60)]   # a 5-step job every 4 steps: never idle
    long_job = Request(60, 0.1, 16, 50)
    first = {}
    for aging in (0.0, 1.0):
        res = simulate(shorts + [long_job], UnitCost(), max_num_seqs=1, scheduling_policy="sjf", sjf_aging=aging)
        assert all(r.finish_time < math.inf for r in res.requests)
        first[aging] = res.requests[-1].first_token_time
        if aging == 0.0:  # without aging it starves until the stream of short jobs ends
            assert first[aging] > max(r.first_token_time for r in res.requests[:-1])
    # aging 1 token/s: it beats every short job that arrived more than 45 s after it, so it waits
    # for at most the ~12 short jobs that arrived before then (5 steps each)
    assert first[1.0] <= 5 + 12 * 5 + 1
    assert first[1.0] < first[0.0] / 4


def test_sjf_with_a_predictor():
    w = mixed_workload(24, seed=4)
    res = simulate(w, UnitCost(), max_num_seqs=2, scheduling_policy="sjf", output_len_predictor=lambda r: r.prompt_len)
    first_batch = {r.request_id for r in res.requests if r.first_token_time == 1.0}
    assert first_batch == set(sorted(range(24), key=lambda i: w[i].prompt_len)[:2])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), budget=st.integers(8, 128), max_seqs=st.integers(1, 6), blocks=st.integers(12, 40),
       chunked=st.booleans(), mode=st.sampled_from(["recompute", "swap"]),
       policy=st.sampled_from(["fcfs", "priority", "sjf"]), seed=st.integers(0, 10_000))
def test_invariants_property(n, budget, max_seqs, blocks, chunked, mode, policy, seed):
    budget = budget if chunked else max(budget, 64 + 32)
    w = make_workload(n, rate=2.0, prompt_len=(1, 64), output_len=(1, 32), priorities=[i % 3 for i in range(n)], seed=seed)
    res = simulate(w, UnitCost(), max_num_batched_tokens=budget, max_num_seqs=max_seqs, block_size=8,
                   num_kv_blocks=blocks, enable_chunked_prefill=chunked, preemption_mode=mode, scheduling_policy=policy)
    for s in res.steps:
        assert s.num_batched_tokens <= budget
        assert sum(kind in ("prefill", "decode") for _, kind in s.slots) <= max_seqs
        assert s.num_blocks_used <= blocks
    for r, req in zip(res.requests, w):
        assert req.arrival_time <= r.first_token_time <= r.finish_time < math.inf
    # every output token comes from exactly one step that completed a sequence's known tokens
    decode_tokens = sum(s.num_decode_seqs for s in res.steps)
    assert decode_tokens <= sum(r.output_len - 1 for r in w) + sum(s.num_prefill_tokens for s in res.steps)


def test_preemption_crossover_short_recompute_long_swap():
    pc = preemption_costs(COST_70B, seq_lens=[16, 64, 256, 1024, 4096, 8192])
    assert pc.recompute_s[0] < pc.swap_s[0]                   # short: recompute rides in the decode step's slack
    assert pc.recompute_s[-1] > pc.swap_s[-1]                 # long: swapping 2.6 GB beats re-prefilling 8K
    assert pc.swap_s[-1] == pytest.approx(2 * 8192 * 327_680 / 64e9)
    fine = preemption_costs(COST_70B)
    assert 100 < fine.crossover_len < 2000
    idle = preemption_costs(COST_70B, seq_lens=[16, 8192], decode_batch=())
    assert idle.crossover_len == 16                            # an idle engine pays the weights: swap always wins


def test_hand_grids_match_the_simulator_and_the_lecture():
    import numpy as np

    from llmso_lab.sim import continuous_slot_grid, lecture_slot_grids, slot_utilization, static_slot_grid
    from llmso_lab.sim.grid import LECTURE_OUTPUT_LENS, LECTURE_WAITING_LENS

    sim = lecture_slot_grids()
    static = static_slot_grid(list(LECTURE_OUTPUT_LENS), 4)
    assert static.shape == (4, 7) and (static < 0).sum() == 12 and slot_utilization(static) == 16 / 28
    assert np.array_equal(static, sim["static"])
    lens = list(LECTURE_OUTPUT_LENS + LECTURE_WAITING_LENS)
    assert np.array_equal(static_slot_grid(lens, 4), sim["static_all"])
    cont = continuous_slot_grid(lens, 4)
    assert cont.shape == (4, 7) and (cont < 0).sum() == 0 and np.array_equal(cont, sim["continuous"])
    assert sorted(np.unique(cont).tolist()) == list(range(7))
    # each request occupies exactly as many cells as it has tokens
    assert [(cont == r).sum() for r in range(7)] == lens
    assert continuous_slot_grid([], 2).shape == (2, 0)


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_engine_traces_draw_the_hand_grids(batching):
    """The real engine (a tiny model) makes the same slot grid as the hand-built ones (Lab 01)."""
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.models import tiny_llama
    from llmso_lab.sim.grid import (LECTURE_OUTPUT_LENS, LECTURE_WAITING_LENS, continuous_slot_grid,
                                    static_slot_grid, trace_slot_grid)

    lens = list(LECTURE_OUTPUT_LENS + LECTURE_WAITING_LENS)
    llm = LLM(tiny_llama(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, max_position_embeddings=64),
              batching=batching, max_num_seqs=4)
    for i, n in enumerate(lens):
        llm.add_request([5 + i] * (3 + i), SamplingParams(max_tokens=n, ignore_eos=True))
    traces = []
    while llm.has_unfinished_requests():
        traces.append(llm.step()[1])
    want = (static_slot_grid if batching == "static" else continuous_slot_grid)(lens, 4)
    np.testing.assert_array_equal(trace_slot_grid(traces, 4), want)
    np.testing.assert_array_equal(trace_slot_grid(traces), want)
