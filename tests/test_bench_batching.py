"""`llmso-lab bench batching`: the result's structure, on a tiny random model (seconds, no download)."""
import json

from llmso_lab.bench.batching import run


def test_bench_batching_structure():
    res = run(quick=True, model="tiny-llama", num_requests=5, max_num_seqs=2, prompt_len=(4, 24),
              output_len=(2, 8), batch1_tokens=6, measure_seconds=0.2)
    assert res["name"] == "batching"
    assert set(res["ratios"]) == {"continuous_vs_static", "continuous_vs_hf_static", "batch1_vs_hf"}
    assert all(v > 0 for v in res["ratios"].values())
    systems = [r["system"] for r in res["table"]]
    assert systems[:3] == ["engine continuous", "engine static", "HF generate static"]
    rows = {r["system"]: r for r in res["table"]}
    assert rows["engine continuous"]["output_tokens"] == rows["engine static"]["output_tokens"] \
        == rows["HF generate static"]["output_tokens"]
    assert all(r["requests"] == 5 for r in res["table"][:3])
    assert rows["engine static"]["padded_tokens"] > 0 == rows["engine continuous"]["padded_tokens"]
    assert res["batch1_ceiling_tok_s"] > 0 and res["memory_bandwidth_GB_s"] > 0
    step = res["batch1_step_ms"]
    assert step["engine"] > step["matmuls_only"] > 0 and step["hf_generate"] > step["matmuls_only"]
    assert abs(step["engine"] - step["matmuls_only"] - step["engine_other_ops"]) < 0.02
    mm_row = rows["engine's weight matmuls alone, batch 1"]
    assert rows["memory-bandwidth ceiling, batch 1"]["decode_tok_s"] >= mm_row["decode_tok_s"] > 0  # a ceiling is never beaten
    assert all(isinstance(v, (int, float, str)) for r in res["table"] for v in r.values())
    json.dumps(res)
    assert {"device", "date", "command"} <= set(res)
