"""The decode-first token budget (llmso_lab.sim.budget) and its use by the simulator; the other batching rules
of `llmso_lab.batching` (what a decode is, the static batch's padded KV reservation)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmso_lab.sim import SimConfig, UnitCost, plan_token_budget, prefill_chunk, simulate
from llmso_lab.workloads import Request


def test_prefill_chunk_rule():
    assert prefill_chunk(100, 64) == 64                                  # chunked: take the leftover
    assert prefill_chunk(100, 64, enable_chunked_prefill=False) == 0     # whole prompt or nothing
    assert prefill_chunk(40, 64, enable_chunked_prefill=False) == 40
    assert prefill_chunk(64, 64, enable_chunked_prefill=False) == 64     # exactly fits
    assert prefill_chunk(5, 0) == 0 and prefill_chunk(0, 10) == 0


def test_decodes_first_then_chunks_in_queue_order():
    plan = plan_token_budget(["d1", "d2", "d3"], [("a", 10), ("b", 100), ("c", 5)], 32)
    assert plan == [("d1", 1), ("d2", 1), ("d3", 1), ("a", 10), ("b", 19)]   # c waits: budget exhausted


def test_chunking_off_stops_at_the_first_prompt_that_does_not_fit():
    plan = plan_token_budget(["d1"], [("a", 10), ("b", 100), ("c", 5)], 32, enable_chunked_prefill=False)
    assert plan == [("d1", 1), ("a", 10)]          # b does not fit whole; c may not jump ahead of it


def test_budget_smaller_than_the_decode_batch_and_max_num_seqs():
    assert plan_token_budget(list(range(5)), [("p", 3)], 3) == [(0, 1), (1, 1), (2, 1)]
    assert plan_token_budget([0, 1], [("p", 3), ("q", 3)], 100, max_num_seqs=3) == [(0, 1), (1, 1), ("p", 3)]
    assert plan_token_budget([], [], 10) == []


def test_budget_exactly_exhausted():
    assert plan_token_budget(["d"], [("a", 7), ("b", 4)], 8) == [("d", 1), ("a", 7)]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 20), st.lists(st.integers(1, 300), max_size=10), st.integers(1, 256), st.integers(1, 16),
       st.booleans())
def test_plan_invariants(num_decodes, prompts, budget, max_seqs, chunked):
    decodes = [f"d{i}" for i in range(num_decodes)]
    prefills = [(f"p{i}", n) for i, n in enumerate(prompts)]
    plan = plan_token_budget(decodes, prefills, budget, max_seqs, chunked)
    assert sum(n for _, n in plan) <= budget and len(plan) <= max_seqs
    ids = [rid for rid, _ in plan]
    k = sum(rid.startswith("d") for rid in ids)
    assert ids[:k] == decodes[:k] and all(n == 1 for _, n in plan[:k])   # decodes first, in order
    assert ids[k:] == [rid for rid, _ in prefills[:len(ids) - k]]          # then a prefix of the queue
    for (rid, n), (_, want) in zip(plan[k:], prefills):
        assert 1 <= n <= want and (chunked or n == want)
    if k < num_decodes:                                                   # a decode was left out: no room
        assert k == min(budget, max_seqs) and len(ids) == k


@pytest.mark.parametrize("chunked", [True, False])
def test_simulator_follows_the_same_rule(chunked):
    # one long prompt joins 3 decoding requests; each step computes what the planner says
    reqs = [Request(i, 0.0, 4, 20) for i in range(3)] + [Request(3, 2.5, 60, 2)]
    res = simulate(reqs, UnitCost(1.0), SimConfig(max_num_batched_tokens=64 if not chunked else 16,
                                                  enable_chunked_prefill=chunked, max_num_seqs=8))
    for step in res.steps:
        assert step.num_batched_tokens <= (16 if chunked else 64)
    joined = [s for s in res.steps if s.num_prefill_tokens and s.num_decode_seqs]
    if chunked:   # 60 prompt tokens in chunks of 16 - 3 = 13 beside the 3 decodes
        assert [s.num_prefill_tokens for s in joined] == [13, 13, 13, 13, 8]
    else:         # the whole prompt in one step next to the decodes: the generation stall
        assert [s.num_prefill_tokens for s in joined] == [60]


def test_is_decode():
    from llmso_lab.batching import is_decode
    assert is_decode(num_tokens=9, num_computed=8, num_output=1)        # computes its last sampled token
    assert not is_decode(num_tokens=9, num_computed=8, num_output=0)    # the last prompt token of a chunked prefill
    assert not is_decode(num_tokens=9, num_computed=0, num_output=2)    # re-prefill after a recompute preemption


def test_static_batch_reserves_a_rectangle():
    from llmso_lab.batching import static_batch
    reqs = [(2, 3), (10, 1), (3, 6), (1, 1)]
    assert static_batch(reqs, 4, 100, 4) == (4, 16)               # longest prompt 10 + most new tokens 6
    assert static_batch(reqs, 4, 15, 4) == (3, 16)                # 4 rows x 4 blocks do not fit 15 blocks
    assert static_batch(reqs, 4, 5, 4) == (1, 5)                  # one row alone: its own 2 + 3 tokens
    assert static_batch(reqs, 2, 100, 4, max_model_len=8) == (2, 8)
    assert static_batch(reqs, 4, 1, 4) == (0, 0) and static_batch([], 4, 100, 4) == (0, 0)
