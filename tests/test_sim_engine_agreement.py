"""The simulator makes the engine's decisions: the same workload through `llmso_lab.engine.LLM` (a tiny
model) and `llmso_lab.sim.simulate` gives, step by step, the same prefills (and their token counts), the
same decodes, idle rows, preemptions and swap-ins. Both apply the rules of `llmso_lab.batching` and
`llmso_lab.policies`; the simulator only adds time."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from llmso_lab.engine import LLM
from llmso_lab.models import tiny_llama
from llmso_lab.sim import SimConfig, UnitCost, decisions_from_engine_traces, decisions_from_sim, run_on_engine, simulate
from llmso_lab.workloads import Request

MODEL = tiny_llama(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, max_position_embeddings=256)
BLOCK, MAX_LEN = 4, 64
# (prompt_len, output_len, priority): a one-token prompt, prompts of 1 block + 1 token, long ones
WORK = [(9, 12, 1), (1, 8, 0), (23, 5, 2), (5, 15, 0), (30, 6, 1), (12, 9, 3), (4, 3, 0), (17, 11, 2)]

CASES = {
    "chunked": dict(max_num_batched_tokens=8),
    "chunked-sjf": dict(max_num_batched_tokens=13, scheduling_policy="sjf", max_num_seqs=3),
    "whole-prompts": dict(max_num_batched_tokens=MAX_LEN, enable_chunked_prefill=False, max_num_seqs=3),
    "recompute": dict(max_num_batched_tokens=16, num_kv_blocks=16),
    "recompute-priority": dict(max_num_batched_tokens=MAX_LEN, enable_chunked_prefill=False, num_kv_blocks=16,
                               scheduling_policy="priority"),
    "swap": dict(max_num_batched_tokens=16, num_kv_blocks=16, preemption_mode="swap"),
    "swap-priority": dict(max_num_batched_tokens=12, num_kv_blocks=17, preemption_mode="swap",
                          scheduling_policy="priority"),
    "static": dict(batching="static", max_num_seqs=3),
    "static-tight-kv": dict(batching="static", max_num_seqs=4, num_kv_blocks=30, scheduling_policy="priority"),
    "dynamic": dict(batching="dynamic", max_num_seqs=3, batch_window_s=0.0),
}


def decisions(work: list[Request], **kw):
    """The workload through the engine and through the simulator: their `StepDecisions` lists."""
    llm = LLM(MODEL, block_size=BLOCK, max_model_len=MAX_LEN, swap_space_blocks=256, **kw)
    engine = decisions_from_engine_traces(run_on_engine(llm, work, seed=0).traces)
    return engine, decisions_from_sim(simulate(work, UnitCost(), SimConfig(block_size=BLOCK, **kw)))


def _first_difference(a, b) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"step {i}: engine {x} vs simulator {y}"
    return f"engine ran {len(a)} steps with a forward, the simulator {len(b)}"


@pytest.mark.parametrize("case", CASES)
def test_engine_and_simulator_make_the_same_decisions(case):
    kw = {"num_kv_blocks": 64, "max_num_seqs": 4, **CASES[case]}
    engine, sim = decisions([Request(i, 0.0, p, o, prio) for i, (p, o, prio) in enumerate(WORK)], **kw)
    assert engine == sim, _first_difference(engine, sim)
    preempted = sum(len(d.preempted) for d in engine)
    if case.startswith(("recompute", "swap")):   # the settings must really exercise preemption
        assert preempted > 0 and (case.startswith("recompute") or any(d.swapped_in for d in engine))
    else:
        assert preempted == 0
    if case.startswith(("static", "dynamic")):
        assert any(d.idle for d in engine)
    if "chunked" in case:   # some prompt really was split into chunks
        assert any(n < WORK[int(r)][0] for d in engine for r, n in d.prefill.items())


@settings(max_examples=25, deadline=None)
@given(work=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=8),
       batching=st.sampled_from(["continuous", "continuous", "static", "dynamic"]), chunked=st.booleans(),
       budget=st.integers(1, 9), blocks=st.sampled_from([16, 20, 64]), max_num_seqs=st.integers(1, 5),
       policy=st.sampled_from(["fcfs", "priority", "sjf"]), mode=st.sampled_from(["recompute", "swap"]))
def test_same_decisions_on_random_workloads(work, batching, chunked, budget, blocks, max_num_seqs, policy, mode):
    kw = dict(batching=batching, enable_chunked_prefill=chunked, max_num_batched_tokens=budget if chunked else MAX_LEN,
              num_kv_blocks=blocks, max_num_seqs=max_num_seqs, scheduling_policy=policy, preemption_mode=mode,
              batch_window_s=0.0)
    engine, sim = decisions([Request(i, 0.0, p, o, prio) for i, (p, o, prio) in enumerate(work)], **kw)
    assert engine == sim, _first_difference(engine, sim)
