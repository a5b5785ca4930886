"""KV waste by allocation scheme: formulas on hand-computed cases, the chat length mix, the engine's own state."""
from __future__ import annotations

import json
from fractions import Fraction

import pytest

from llmso_lab.kv.fragmentation import engine_occupancy, kv_occupancy, max_batch, waste
from llmso_lab.workloads import CHAT_LENGTHS_PATH, chat_length_mix, load_chat_lengths, write_chat_lengths

LENGTHS = [(10, 5), (3, 1)]          # (prompt, output)
KW = dict(max_model_len=32, max_tokens=8, block_size=4)


@pytest.mark.parametrize("scheme,moment,expected", [
    # at finish: 15 + 4 = 19 tokens stored
    ("contiguous_max_len", "at_finish", Fraction(19, 64)),      # 2 x 32 reserved
    ("contiguous_max_tokens", "at_finish", Fraction(19, 29)),   # (10 + 8) + (3 + 8)
    ("paged", "at_finish", Fraction(19, 20)),                   # 16 + 4
    # lifetime: states 10..14 (60 tokens) and 3 (3 tokens) = 63 tokens over 6 states
    ("contiguous_max_len", "lifetime", Fraction(63, 192)),      # 6 x 32
    ("contiguous_max_tokens", "lifetime", Fraction(63, 101)),   # 5 x 18 + 11
    ("paged", "lifetime", Fraction(63, 72)),                    # 12+12+12+16+16 + 4
])
def test_waste_hand_computed(scheme, moment, expected):
    assert waste(LENGTHS, scheme, moment=moment, **KW) == pytest.approx(float(1 - expected), abs=1e-12)


def test_paged_waste_only_last_block_and_block_one_wastes_nothing():
    assert waste([(7, 9)], "paged", block_size=1) == 0.0
    assert waste([(16, 16)], "paged", block_size=16, moment="at_finish") == 0.0      # 32 tokens, 2 full blocks
    assert waste([(17, 16)], "paged", block_size=16, moment="at_finish") == pytest.approx(1 - 33 / 48)
    sizes = [waste(LENGTHS * 3, "paged", block_size=b) for b in (1, 2, 4, 8, 16)]
    assert sizes == sorted(sizes)


def test_max_batch_hand_computed():
    lengths = [(10, 5), (3, 1), (20, 10)]
    kw = dict(max_model_len=32, max_tokens=10, block_size=4)
    assert max_batch(lengths, "contiguous_max_len", 40, **kw) == 1       # 32, then 64 > 40
    assert max_batch(lengths, "contiguous_max_tokens", 40, **kw) == 2    # 20 + 13 = 33, then + 30
    assert max_batch(lengths, "paged", 52, **kw) == 3                    # 16 + 4 + 32 = 52
    assert max_batch(lengths, "paged", 51, **kw) == 2


@pytest.mark.parametrize("args,kwargs,match", [
    ((LENGTHS, "buddy"), KW, "unknown scheme"),
    ((LENGTHS, "paged"), {}, "needs block_size"),
    ((LENGTHS, "contiguous_max_len"), {}, "needs max_model_len"),
    ((LENGTHS, "contiguous_max_tokens"), dict(max_tokens=4), "exceeds max_tokens"),
    ((LENGTHS, "contiguous_max_len"), dict(max_model_len=12), "does not fit max_model_len"),
    (([(0, 3)], "paged"), dict(block_size=4), ">= 1"),
    ((LENGTHS, "paged"), dict(block_size=4, moment="peak"), "unknown moment"),
])
def test_bad_input_says_what_to_do(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        waste(*args, **kwargs)


def test_chat_lengths_file_is_what_the_generator_writes(tmp_path):
    assert write_chat_lengths(tmp_path / "c.json").read_text() == CHAT_LENGTHS_PATH.read_text()
    lengths, params = load_chat_lengths()
    assert lengths == chat_length_mix(**{k: v for k, v in params.items()})
    assert len(lengths) == params["n"] == 1000
    assert all(p + o <= params["max_model_len"] and o <= params["max_tokens"] for p, o in lengths)
    doc = json.loads(CHAT_LENGTHS_PATH.read_text())
    assert 140 < doc["mean_prompt_len"] < 190 and 300 < doc["mean_output_len"] < 360   # ShareGPT-like (161, 338)
    with pytest.raises(ValueError, match="write_chat_lengths"):
        load_chat_lengths(tmp_path / "missing.json")


@pytest.mark.parametrize("block_size", [4, 16])
def test_engine_state_equals_the_lifetime_formula(block_size):
    """Read from the engine's block manager after every step, summed over steps, the waste is exactly the
    lifetime formula (whole prompts, no preemption); the per-step waste peaks above its mean."""
    from llmso_lab.bench.paged import engine_waste
    from llmso_lab.models import tiny_llama

    lengths = [(5, 3), (17, 6), (32, 1), (9, 12), (1, 4), (23, 7)]
    res = engine_waste(tiny_llama(), lengths, block_size, max_num_seqs=3, max_model_len=64,
                       max_num_batched_tokens=256)
    assert res["preemptions"] == 0
    assert res["all_steps"] == pytest.approx(waste(lengths, "paged", block_size=block_size), abs=1e-12)
    assert 0 < res["mean"] < res["peak"] < 1


def test_engine_occupancy_reads_blocks_and_needs_every_holder():
    from llmso_lab.engine import LLM, SamplingParams
    from llmso_lab.models import tiny_llama

    llm = LLM(tiny_llama(), block_size=4, max_num_seqs=2, max_model_len=32)
    llm.add_request([5] * 6, SamplingParams(max_tokens=3, ignore_eos=True))
    llm.add_request([7] * 9, SamplingParams(max_tokens=3, ignore_eos=True))
    llm.step()                                         # both prompts computed: 6 + 9 tokens in 2 + 3 blocks
    assert engine_occupancy(llm) == (15, 20)
    llm.step()                                         # one decode each: 7 + 10 tokens, still 2 + 3 blocks
    assert engine_occupancy(llm) == (17, 20)
    with pytest.raises(ValueError, match="pass every sequence"):
        kv_occupancy(llm.block_manager, llm.scheduler.running[:1])


def test_bench_paged_quick_structure():
    from llmso_lab.bench.paged import run

    res = run(quick=True, engine_requests=2, engine_max_num_seqs=2)
    r = res["ratios"]
    assert {"contiguous_waste", "contiguous_max_tokens_waste", "paged_waste_block16", "paged_waste_block16_engine_mean",
            "paged_waste_block16_engine_peak", "max_batch_contiguous", "max_batch_contiguous_max_tokens",
            "max_batch_paged_block16", "batch_gain_paged16_over_contiguous"} <= set(r)
    assert r["paged_waste_block16"] < r["contiguous_max_tokens_waste"] < r["contiguous_waste"]
    assert r["max_batch_contiguous"] == res["budget_slots"] // 2048
    assert r["max_batch_paged_block16"] > r["max_batch_contiguous_max_tokens"] > r["max_batch_contiguous"]
    engine_row = next(row for row in res["table"] if row["scheme"] == "paged: engine")
    assert engine_row["engine_all_steps"] == pytest.approx(engine_row["waste_lifetime"], abs=1e-4)
    json.dumps(res)
