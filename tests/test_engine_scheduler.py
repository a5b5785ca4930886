"""Scheduler behaviour seen through `LLM.step()` traces: token budget, chunked prefill, preemption and
victims, policies, static / dynamic / continuous batching, prefix caching, and hypothesis properties."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.models import tiny_llama

MODEL = tiny_llama(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, max_position_embeddings=256)


def llm(**kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 64)
    return LLM(MODEL, **kw)


def sp(n, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def prompt(n, start=3):
    return {"prompt_token_ids": [(start + 7 * i) % 250 + 3 for i in range(n)]}


def run(engine, max_steps=10_000):
    """Step until idle; returns (outputs by request id, traces)."""
    outputs, traces = {}, []
    while engine.has_unfinished_requests():
        finished, trace = engine.step()
        engine.scheduler.check_invariants()
        traces.append(trace)
        outputs.update({o.request_id: o for o in finished})
        assert len(traces) < max_steps
    return outputs, traces


def test_decode_first_then_prefill_chunks_in_the_leftover_budget():
    e = llm(max_num_batched_tokens=8)
    for i in range(3):
        e.add_request(prompt(2, i), sp(30))
    e.step()   # the three short prompts
    e.step()   # three decodes
    long_id = e.add_request(prompt(40), sp(2))
    chunks = []
    for _ in range(8):
        _, t = e.step()
        assert len(t.decode) == 3, "running decodes must never be starved by a prefill"
        assert t.num_batched_tokens <= 8
        if long_id in t.prefill:
            chunks.append(t.prefill[long_id])
    assert chunks == [5] * 8   # 8 - 3 decodes = 5 tokens of the long prompt per step: 40 = 8 chunks


def test_without_chunked_prefill_a_prompt_is_scheduled_whole():
    e = llm(enable_chunked_prefill=False, max_num_batched_tokens=64)
    lens = [30, 5, 40, 12, 33, 8]
    for i, n in enumerate(lens):
        e.add_request(prompt(n, i), sp(6))
    _, traces = run(e)
    for t in traces:
        assert t.num_batched_tokens <= 64
        for rid, n in t.prefill.items():
            assert n == lens[int(rid)]


def test_max_num_seqs_is_respected():
    e = llm(max_num_seqs=3)
    for i in range(8):
        e.add_request(prompt(3 + i, i), sp(4 + i))
    _, traces = run(e)
    assert max(len(t.prefill) + len(t.decode) for t in traces) == 3
    assert all(t.num_running <= 3 for t in traces)


def _preempting_run(**kw):
    e = llm(num_kv_blocks=16, max_num_batched_tokens=64, **kw)   # 4 requests of up to 36 tokens cannot all fit
    for i in range(4):
        e.add_request(prompt(4, i), sp(32), priority=[1, 5, 0, 2][i])
    return e, *run(e)


def test_fcfs_victim_is_the_latest_arrival_and_returns_first():
    e, outs, traces = _preempting_run()
    preempting = [t for t in traces if t.preempted]
    assert preempting and e.stats()["num_preemptions_total"] == sum(len(t.preempted) for t in traces)
    for t in preempting:   # everyone kept running arrived before every victim
        kept = list(t.decode) + list(t.prefill)
        assert max(map(int, kept), default=-1) < min(map(int, t.preempted))
    # recompute requeues at the front: the earliest victim is readmitted before any later-arrived request
    first = preempting[0]
    victims = sorted(first.preempted, key=int)
    later = [t for t in traces if t.step > first.step and set(t.prefill) & set(victims)]
    assert victims[0] in later[0].prefill
    assert sum(o.metrics.num_preemptions for o in outs.values()) == e.stats()["num_preemptions_total"]


def test_fcfs_recompute_victim_goes_back_to_the_front_of_the_queue():
    """A later request is already waiting when the victim is preempted; the victim is readmitted first."""
    e = llm(num_kv_blocks=16, max_num_seqs=2)
    for i in range(3):
        e.add_request(prompt(8, i), sp(40))
    outs, traces = run(e)
    first = next(t for t in traces if t.preempted)
    assert first.preempted == ["1"]
    readmitted = next(t.step for t in traces if t.step > first.step and "1" in t.prefill)
    admitted_2 = next(t.step for t in traces if "2" in t.prefill)
    assert readmitted <= admitted_2   # head-of-line: the victim blocks later arrivals until it fits


def test_identical_prompt_reuses_all_but_the_last_block():
    e = llm(enable_prefix_caching=True)
    p = prompt(8)                                           # exactly two blocks
    a = e.generate(p, sp(6), use_tqdm=False)[0]
    b = e.generate(p, sp(6), use_tqdm=False)[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 4   # the last block is recomputed for logits
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_priority_victim_is_the_largest_priority_value():
    prio = {"0": 1, "1": 5, "2": 0, "3": 2}
    e, outs, traces = _preempting_run(scheduling_policy="priority")
    preempting = [t for t in traces if t.preempted]
    assert preempting
    for t in preempting:
        kept = list(t.decode) + list(t.prefill)
        assert max((prio[r], int(r)) for r in kept) < min((prio[r], int(r)) for r in t.preempted)


def test_swap_preemption_swaps_in_again():
    e, outs, traces = _preempting_run(preemption_mode="swap")
    s = e.stats()
    assert s["num_preemptions_swap"] > 0 and s["num_preemptions_total"] == s["num_preemptions_swap"] + s["num_preemptions_recompute"]
    assert any(t.swapped_in for t in traces)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs.values())


def _completion_order(e):
    order = []
    while e.has_unfinished_requests():
        finished, _ = e.step()
        order += [o.request_id for o in finished]
    return order


def test_priority_admission_order():
    e = llm(max_num_seqs=1, scheduling_policy="priority")
    for p in [3, 1, 2, 1]:
        e.add_request(prompt(3), sp(3), priority=p)
    assert _completion_order(e) == ["1", "3", "2", "0"]   # lower value first, ties by arrival


def test_sjf_oracle_order():
    e = llm(max_num_seqs=1, scheduling_policy="sjf")
    for n in [9, 3, 6, 1]:
        e.add_request(prompt(3), sp(n))
    assert _completion_order(e) == ["3", "1", "2", "0"]


def test_sjf_mean_predictor_learns_output_lengths():
    e = llm(max_num_seqs=1, scheduling_policy="sjf", sjf_predictor="mean")
    for n in [4, 6]:
        e.add_request(prompt(3), sp(n))
    run(e)
    assert e.scheduler.policy.mean == pytest.approx(5.0)


@pytest.mark.parametrize("aging,starves", [(0.0, True), (1.0, False)])
def test_sjf_aging_prevents_starvation(aging, starves):
    """Aging is in predicted tokens forgiven per second waited on the engine clock (as in the simulator)."""
    now = [0.0]
    e = llm(max_num_seqs=1, scheduling_policy="sjf", sjf_aging=aging, clock=lambda: now[0])
    long_id = e.add_request(prompt(3), sp(30))
    started = False
    for step in range(150):          # a new short job arrives every second: more than the engine can serve
        e.add_request(prompt(3, step), sp(2))
        _, t = e.step()
        now[0] += 1.0
        started |= long_id in t.prefill
    assert started is not starves


def test_engine_and_simulator_share_the_policy_keys():
    """One definition (llmso_lab.policies): the engine's admission order is `serve_order` of its queue."""
    from llmso_lab.policies import serve_order

    e = llm(max_num_seqs=1, scheduling_policy="priority")
    for p in [2, 0, 1]:
        e.add_request(prompt(3), sp(1), priority=p)
    queue = list(e.scheduler.waiting)
    assert [s.request_id for s in e.scheduler.policy.order(queue, now=0.0)] == \
        [s.request_id for s in serve_order(queue, "priority")] == ["1", "2", "0"]


def test_static_batching_reproduces_the_lecture_grid():
    """4 slots x 7 iterations with outputs of 7, 3, 5 and 1 tokens: 12 of the 28 slots are idle."""
    e = llm(batching="static", max_num_seqs=4)
    for n in [7, 3, 5, 1]:
        e.add_request(prompt(4), sp(n))
    for n in [2, 2]:                 # a second batch that must wait for the whole first one
        e.add_request(prompt(4), sp(n))
    outs, traces = run(e)
    first = [t for t in traces if t.num_tokens and set(t.num_tokens) <= {"0", "1", "2", "3"}]
    assert len(first) == 7 and sum(len(t.num_tokens) for t in first) == 28
    assert sum(len(t.idle) for t in first) == 12
    assert all(not (set(t.num_tokens) & {"0", "1", "2", "3"} and set(t.num_tokens) & {"4", "5"}) for t in traces)
    assert [len(outs[str(i)].outputs[0].token_ids) for i in range(6)] == [7, 3, 5, 1, 2, 2]
    # a short request in a static batch is only returned when the batch ends (head-of-line blocking)
    assert outs["3"].metrics.finish_time == outs["0"].metrics.finish_time


def test_continuous_batching_fills_freed_slots_immediately():
    e = llm(max_num_seqs=4)
    for n in [7, 3, 5, 1, 2, 2]:
        e.add_request(prompt(4), sp(n))
    _, traces = run(e)
    assert all(not t.idle for t in traces)
    assert "4" in traces[1].prefill   # request 3 finished in step 0, retired in step 1, its slot reused at once


def test_static_batching_pads_prompts_to_the_longest():
    e = llm(batching="static")
    e.add_request(prompt(2), sp(3))
    e.add_request(prompt(6), sp(3))
    _, t = e.step()
    assert t.num_tokens == {"0": 6, "1": 6} and t.num_padded_tokens == 4 and t.prefill == {"0": 2, "1": 6}


def test_static_batch_reserves_the_padded_rectangle():
    """Like HF generate's [batch, longest prompt + max new tokens] KV cache: every row reserves the blocks of the
    batch's longest prompt + largest max_tokens (10 + 6 = 16 tokens = 4 blocks), and the batch takes only as
    many rows as that rectangle fits (16 blocks: 4 of the 5 requests)."""
    e = llm(batching="static", max_num_seqs=5, num_kv_blocks=16)
    for n, m in [(2, 3), (10, 1), (3, 6), (1, 1), (4, 2)]:
        e.add_request(prompt(n), sp(m))
    _, t = e.step()
    assert sorted(t.prefill) == ["0", "1", "2", "3"] and t.num_blocks_used == 4 * 4
    outs, _ = run(e)
    assert len(outs["4"].outputs[0].token_ids) == 2   # the fifth request ran in the next batch


def test_dynamic_batching_waits_for_full_batch_or_window():
    now = [0.0]
    e = llm(batching="dynamic", max_num_seqs=4, batch_window_s=0.05, clock=lambda: now[0])
    e.add_request(prompt(3), sp(2))
    e.add_request(prompt(3), sp(2))
    assert e.step()[1].num_batched_tokens == 0
    now[0] = 0.04
    assert e.step()[1].num_batched_tokens == 0
    now[0] = 0.06                                  # the window closed: run with 2 of 4 slots
    assert set(e.step()[1].prefill) == {"0", "1"}
    run(e)
    for i in range(4):                             # a full batch starts at once
        e.add_request(prompt(3), sp(2))
    assert len(e.step()[1].prefill) == 4


def test_future_arrivals_wait_for_their_time():
    now = [10.0]
    e = llm(clock=lambda: now[0])
    rid = e.add_request(prompt(3), sp(2), arrival_time=12.0)
    assert e.step()[1].num_batched_tokens == 0 and e.has_unfinished_requests()
    now[0] = 12.5
    assert rid in e.step()[1].prefill
    outs, _ = run(e)
    m = outs[rid].metrics
    assert m.arrival_time == 12.0 and m.ttft == pytest.approx(0.5) and m.e2e >= m.ttft


def test_prefix_caching_saves_prefill_and_keeps_outputs():
    system = [(11 * i) % 250 + 3 for i in range(24)]    # 6 full blocks shared by every request
    prompts = [{"prompt_token_ids": system + [100 + i, 7, i]} for i in range(6)]

    def go(caching):
        e = llm(enable_prefix_caching=caching, max_num_batched_tokens=32)
        outs = e.generate(prompts, sp(5), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], e.stats(), outs

    plain, s0, _ = go(False)
    cached, s1, outs = go(True)
    assert cached == plain
    assert s0["prefix_cache_hit_rate"] == 0 and s1["prefix_cache_hit_rate"] > 0.5
    assert s1["num_computed_tokens"] < s0["num_computed_tokens"] - 3 * 24
    assert sum(o.num_cached_tokens for o in outs) >= 4 * 24


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 10), st.integers(0, 3)), min_size=1, max_size=7),
       batching=st.sampled_from(["continuous", "continuous", "static", "dynamic"]),
       budget=st.integers(1, 24), chunked=st.booleans(), block_size=st.sampled_from([1, 2, 4, 8]),
       extra_blocks=st.integers(0, 30), caching=st.booleans(), mode=st.sampled_from(["recompute", "swap"]),
       policy=st.sampled_from(["fcfs", "priority", "sjf"]), max_num_seqs=st.integers(1, 5))
def test_properties_random_workloads(lens, batching, budget, chunked, block_size, extra_blocks, caching, mode, policy, max_num_seqs):
    """Whatever the workload and settings: the token budget holds every step, ref counts match holders,
    blocks never leak, every request finishes with exactly max_tokens tokens, preemptions add up."""
    max_len = 32
    if not chunked and batching == "continuous":
        budget = max(budget, max_len)
    e = LLM(MODEL, block_size=block_size, max_model_len=max_len, num_kv_blocks=-(-max_len // block_size) + extra_blocks,
            max_num_batched_tokens=budget, enable_chunked_prefill=chunked, batching=batching, batch_window_s=0.0,
            enable_prefix_caching=caching, preemption_mode=mode, scheduling_policy=policy, max_num_seqs=max_num_seqs,
            swap_space_blocks=8)
    for i, (n, m, prio) in enumerate(lens):
        e.add_request([(i % 2 + 3 * j) % 250 + 3 for j in range(n)], sp(m), priority=prio)   # prefixes repeat
    outs, traces = run(e, max_steps=2000)
    for t in traces:
        if batching == "continuous":
            assert t.num_batched_tokens <= budget
        assert t.num_running <= max_num_seqs
    assert len(outs) == len(lens)
    for i, (n, m, _) in enumerate(lens):
        assert len(outs[str(i)].outputs[0].token_ids) == m
    assert e.block_manager.num_used_blocks == 0 and e.block_manager.num_free_blocks == e.block_manager.num_blocks
    if mode == "swap":   # every host pool block is back
        assert len(e.scheduler.preemption.space.free_ids) == e.scheduler.preemption.space.num_swap_blocks
    total = e.stats()["num_preemptions_total"]
    assert total == sum(len(t.preempted) for t in traces) == sum(o.metrics.num_preemptions for o in outs.values())


@pytest.mark.timeout(20)
def test_dynamic_generate_with_a_frozen_clock_raises_instead_of_hanging():
    """An injected clock that never moves: the batch window never closes, so `generate` must say so
    instead of spinning forever. (`step()` itself may idle: the caller moves the clock, as above.)"""
    e = llm(batching="dynamic", max_num_seqs=4, batch_window_s=0.05, clock=lambda: 0.0)
    with pytest.raises(RuntimeError, match="clock"):
        e.generate([prompt(3), prompt(4)], sp(2), use_tqdm=False)


def test_swap_with_prefix_caching_preempts_no_more_than_recompute():
    """With a shared system prompt and too few KV blocks, swap and recompute hold the same blocks: a victim's
    shared prefix stays cached either way, and a swapped-in victim shares it again instead of copying it into
    fresh blocks (which would crowd out the others and force extra preemptions). So both modes preempt the same
    requests at the same steps; only how the victim's KV comes back differs. Greedy tokens equal HF's."""
    from llmso_lab.engine.hf_reference import hf_greedy

    system = [(11 * i) % 250 + 3 for i in range(16)]
    prompts = [system + [100 + i] * 6 for i in range(5)]
    runs = {}
    for mode in ("swap", "recompute"):
        e = LLM(MODEL, block_size=4, max_model_len=40, num_kv_blocks=14, enable_prefix_caching=True,
                preemption_mode=mode, swap_space_blocks=64, max_num_batched_tokens=64)
        for p in prompts:
            e.add_request(p, sp(8))
        outs, traces = run(e)
        runs[mode] = (outs, [(t.step, t.preempted) for t in traces if t.preempted], len(traces), e.stats())
    (swap_outs, swap_preempted, swap_steps, s), (rec_outs, rec_preempted, rec_steps, _) = runs["swap"], runs["recompute"]
    assert s["num_preemptions_swap"] > 0
    assert swap_preempted == rec_preempted and swap_steps == rec_steps
    for i, p in enumerate(prompts):
        assert swap_outs[str(i)].outputs[0].token_ids == rec_outs[str(i)].outputs[0].token_ids == hf_greedy(MODEL, p, 8)
