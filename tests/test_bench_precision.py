"""`llmso-lab bench precision` and `--dtype`: the result's structure on a tiny random model (seconds, no
download), the workload's roofline bound, and the CLI."""
import json
import math

import pytest
import torch

from llmso_lab import hardware as hw

from llmso_lab.bench.precision import roofline_share, run
from llmso_lab.cli import main
from llmso_lab.models.shapes import SMOLLM2_135M

TINY = dict(model="tiny-llama", prefill_lens=(16, 32), decode_tokens=4, decode_batch=3, repeats=1, measure_seconds=0.2,
            workload=dict(num_requests=4, prompt_len=(4, 12), output_len=(2, 6), max_num_seqs=2, batch1_tokens=4),
            workload_rounds=2)


def test_bench_precision_structure():
    res = run(quick=True, dtypes=("float32", "bfloat16"), **TINY)
    assert res["name"] == "precision" and [r["dtype"] for r in res["table"]] == ["float32", "bfloat16"]
    assert {"bf16_vs_fp32_prefill", "bf16_vs_fp32_prefill_32", "bf16_vs_fp32_batch1", "bf16_vs_fp32_batch3",
            "bf16_vs_fp32_continuous_throughput", "fp32_over_bf16_ttft_p50", "fp32_over_bf16_ttft_p99",
            "bf16_tokens_equal_vs_fp32", "bf16_vs_fp32_continuous_throughput_worst_round",
            "fp32_over_bf16_ttft_p50_worst_round"} == set(res["ratios"])
    assert all(v > 0 for v in res["ratios"].values())
    f32, b16 = res["table"]
    for row in res["table"]:
        assert row["prefill_16_tok_s"] > 0 and row["decode_b1_tok_s"] > 0 and row["decode_b3_tok_s"] > 0
        assert row["continuous_tok_s"] > 0 and 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert row["roofline_bound_tok_s"] > 0 and row["roofline_share"] == pytest.approx(
            row["continuous_tok_s"] / row["roofline_bound_tok_s"], rel=0.01, abs=1e-3)   # rounded to 3 places
    assert f32["tokens_equal_vs_fp32"] == f32["identical_vs_fp32"] == 1.0   # fp32 against itself
    assert 0 <= b16["tokens_equal_vs_fp32"] <= 1
    assert res["ratios"]["bf16_vs_fp32_prefill"] == pytest.approx(b16["prefill_16_tok_s"] / f32["prefill_16_tok_s"], rel=0.01,
                                                                  abs=1e-3)   # the ratio is rounded to 3 decimals
    assert set(res["targets"]) == {"continuous throughput >= 1.5x fp32", "TTFT p50 >= 1.5x lower", "both, in every round"}
    # the continuous workload: two rounds, the dtypes alternating; the table keeps each dtype's best round
    rounds = res["tables"]["continuous workload, round by round (the dtypes alternate)"]
    assert [(x["round"], x["dtype"]) for x in rounds] == [(1, "float32"), (1, "bfloat16"), (2, "float32"), (2, "bfloat16")]
    for row in res["table"]:
        mine = [x for x in rounds if x["dtype"] == row["dtype"]]
        assert row["continuous_tok_s"] == max(x["continuous_tok_s"] for x in mine)
        assert row["linear_kernel"] in ("oneDNN packed", "aten matmul")
    # fp32 is prepacked only where the packed kernel measured faster on this CPU (`hw.onednn_linear_available`)
    assert f32["linear_kernel"] == ("oneDNN packed" if hw.onednn_linear_available(torch.float32, "cpu") else "aten matmul")
    for x in rounds:   # every step is a prefill step or a pure decode step: their times add up to the run's steps
        assert x["prefill_steps"] >= 1 and x["decode_steps"] >= 1 and 1 <= x["decode_batch_mean"] <= 2
        assert x["prefill_steps_s"] > 0 and x["decode_steps_s"] > 0
    assert all(x["vs_fp32_tok_s"] == 1.0 for x in rounds if x["dtype"] == "float32")
    assert all(x["same_tokens_as_round_1"] is True for x in rounds)   # greedy, same inputs: each round repeats round 1
    bf = [x for x in rounds if x["dtype"] == "bfloat16"]
    assert res["ratios"]["bf16_vs_fp32_continuous_throughput_worst_round"] == pytest.approx(
        min(x["vs_fp32_tok_s"] for x in bf), abs=2e-3)
    assert res["targets"]["both, in every round"] == (min(res["ratios"]["bf16_vs_fp32_continuous_throughput_worst_round"],
                                                          res["ratios"]["fp32_over_bf16_ttft_p50_worst_round"]) >= 1.5)
    assert res["chat_agreement"] == {}   # the tiny model has no tokenizer
    json.dumps(res)
    assert {"device", "date", "command", "auto_dtype", "cpu_flags"} <= set(res)


def test_paired_rounds_compare_each_round_with_its_own_fp32():
    from llmso_lab.bench.precision import paired_rounds
    rows = [{"round": 1, "dtype": "float32", "continuous_tok_s": 100.0, "ttft_p50_s": 30.0},
            {"round": 1, "dtype": "bfloat16", "continuous_tok_s": 160.0, "ttft_p50_s": 20.0},
            {"round": 2, "dtype": "float32", "continuous_tok_s": 80.0, "ttft_p50_s": 40.0},   # a slower round
            {"round": 2, "dtype": "bfloat16", "continuous_tok_s": 140.0, "ttft_p50_s": 25.0}]
    got = {(x["round"], x["dtype"]): (x["vs_fp32_tok_s"], x["fp32_over_this_ttft_p50"]) for x in paired_rounds(rows)}
    assert got[1, "bfloat16"] == (1.6, 1.5) and got[2, "bfloat16"] == (1.75, 1.6)
    assert got[2, "float32"] == (1.0, 1.0)   # not 140 / 100 across rounds


def test_step_split_separates_prefill_steps_from_pure_decode_steps():
    from llmso_lab.bench.precision import step_split
    from llmso_lab.engine.metrics import StepTrace
    traces = [StepTrace(0, 0.0, 0.5, prefill={"a": 100}), StepTrace(1, 0.5, 0.3, prefill={"b": 50}, decode=["a"]),
              StepTrace(2, 0.8, 0.1, decode=["a", "b"]), StepTrace(3, 0.9, 0.05, decode=["b"]),
              StepTrace(4, 0.95, 0.0)]   # an empty step counts as neither
    got = step_split(traces)
    assert (got["prefill_steps"], got["decode_steps"]) == (2, 2)
    assert got["prefill_steps_s"] == pytest.approx(0.8) and got["decode_steps_s"] == pytest.approx(0.15)
    assert got["decode_step_ms"] == pytest.approx(75.0) and got["decode_batch_mean"] == 1.5


def test_roofline_bound_counts_prefill_flops_and_the_fewest_decode_steps():
    s, peak, bw = SMOLLM2_135M, 1e12, 1e10
    prompts, outputs = [10, 10], [3, 5]   # decode tokens 2 and 4
    kv = s.kv_bytes_per_token(2)
    from llmso_lab.sim.cost import StepCost
    from llmso_lab.hardware import Accelerator
    flops = StepCost(Accelerator("x", peak, bw, 0, "none", 0, 0), s, 2).work(prefill=[(10, 0), (10, 0)])[0]
    kv_reads = (11 + 12) + (11 + 12 + 13 + 14)
    for max_num_seqs, steps in ((1, 6), (2, 4), (8, 4)):   # at most max_num_seqs per step; the longest needs 4
        want = sum(outputs) / (flops / peak + (steps * s.weight_bytes(2) + kv_reads * kv) / bw)
        bound, share = roofline_share(50.0, prompts, outputs, max_num_seqs, s, 2, peak, bw)
        assert math.isclose(bound, want, rel_tol=1e-12) and math.isclose(share, 50.0 / want, rel_tol=1e-12)


def test_cli_env_says_what_auto_picks_and_bench_dtype_is_checked(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "LLM(dtype='auto')" in out and "bfloat16 matmul" in out
    assert main(["bench", "prefix", "--dtype", "bfloat16"]) == 2
    assert "benchmark 'prefix' has no --dtype" in capsys.readouterr().err


def test_bench_batching_runs_in_bf16():
    from llmso_lab.bench.batching import run as run_batching

    res = run_batching(quick=True, model="tiny-llama", num_requests=3, max_num_seqs=2, prompt_len=(4, 12),
                       output_len=(2, 5), batch1_tokens=4, measure_seconds=0.2, dtype="bfloat16")
    assert res["dtype"] == "bfloat16" and res["command"].endswith("--dtype bfloat16")
    assert "bfloat16 weights" in [r for r in res["table"] if r["system"].startswith("memory-bandwidth")][0]["note"]
