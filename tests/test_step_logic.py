"""`retire_and_admit`: the lecture's scheduler steps 1-3 in miniature (Lab 01's reference), and that the
real engine makes the same decisions."""
import random

import pytest

from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.models import tiny_llama
from llmso_lab.sim.step_logic import retire_and_admit


def run(running=(), waiting=(), free_blocks=10, block_size=16, max_num_seqs=4, max_num_batched_tokens=256):
    return retire_and_admit(list(running), list(waiting), free_blocks, block_size, max_num_seqs, max_num_batched_tokens)


def seq(i, out, max_tokens, blocks=1, eos=False):
    return {"id": i, "output_len": out, "max_tokens": max_tokens, "eos": eos, "blocks": blocks}


def req(i, prompt_len):
    return {"id": i, "prompt_len": prompt_len}


def test_retires_eos_and_max_tokens_and_returns_their_blocks():
    res = run([seq("a", 3, 3, blocks=2), seq("b", 1, 5, blocks=1, eos=True), seq("c", 2, 5, blocks=4)], [], free_blocks=1)
    assert res["retired"] == ["a", "b"]
    assert res["free_blocks"] == 1 + 2 + 1
    assert res["running"] == ["c"] and res["num_batched_tokens"] == 1 and res["free_blocks_left"] == 4


def test_admits_fcfs_while_slots_budget_and_blocks_last():
    res = run([seq(0, 1, 4)], [req(1, 16), req(2, 17), req(3, 5)], free_blocks=3, block_size=16)
    assert res["admitted"] == [1, 2] and res["running"] == [0, 1, 2]          # 1 + 2 blocks
    assert res["free_blocks_left"] == 0 and res["num_batched_tokens"] == 1 + 16 + 17
    assert run([], [req(1, 16), req(2, 17), req(3, 5)], free_blocks=2)["admitted"] == [1]   # 2 needs 2 blocks


def test_no_overtaking_the_head_of_the_queue():
    res = run([], [req(1, 300), req(2, 4)], max_num_batched_tokens=256)      # 1 can never fit this budget
    assert res["admitted"] == [] and res["num_batched_tokens"] == 0


def test_limits_are_inclusive():
    assert run([seq(0, 1, 9)], [req(1, 255)], free_blocks=16, max_num_batched_tokens=256)["admitted"] == [1]   # budget exactly used
    assert run([], [req(1, 32)], free_blocks=2, block_size=16)["free_blocks_left"] == 0         # blocks exactly used
    assert run([seq(i, 0, 9) for i in range(3)], [req(7, 1), req(8, 1)], max_num_seqs=4)["admitted"] == [7]


def test_empty_inputs():
    assert run() == {"retired": [], "free_blocks": 10, "admitted": [], "running": [], "num_batched_tokens": 0,
                     "free_blocks_left": 10}


def _state(llm):
    """The engine's scheduler state before a step, in `retire_and_admit`'s terms."""
    sch = llm.scheduler
    running = [{"id": s.request_id, "output_len": s.num_output_tokens, "max_tokens": s.sampling_params.max_tokens,
                "eos": s.finish_reason == "stop", "blocks": len(s.block_table)} for s in sch.running]
    waiting = [{"id": s.request_id, "prompt_len": s.num_prompt_tokens} for s in sch.waiting]
    return running, waiting, llm.block_manager.num_free_blocks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_engine_makes_the_same_decisions(seed):
    """Continuous batching, chunked prefill off; sequences never grow a block, so decodes take none."""
    rng = random.Random(seed)
    model = tiny_llama(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, max_position_embeddings=64)
    bs, cfg = 32, dict(max_num_seqs=3, max_num_batched_tokens=64)
    llm = LLM(model, block_size=bs, num_kv_blocks=4, max_model_len=64, enable_chunked_prefill=False, **cfg)
    for i in range(12):
        p = rng.randint(2, 50)
        m = rng.randint(1, 10)
        while -(-(p + m) // bs) != -(-p // bs):   # keep prompt + output inside the prompt's last block
            m -= 1
        llm.add_request([rng.randrange(3, 256) for _ in range(p)], SamplingParams(max_tokens=max(m, 1)))
    steps = 0
    while llm.has_unfinished_requests():
        running, waiting, free = _state(llm)
        want = retire_and_admit(running, waiting, free, bs, cfg["max_num_seqs"], cfg["max_num_batched_tokens"])
        _, trace = llm.step()
        assert trace.retired == want["retired"]
        assert trace.num_free_blocks_before == want["free_blocks"]
        assert list(trace.prefill) == want["admitted"]
        assert trace.num_batched_tokens == want["num_batched_tokens"]
        assert trace.num_blocks_free == want["free_blocks_left"]
        steps += 1
    assert steps > 12
