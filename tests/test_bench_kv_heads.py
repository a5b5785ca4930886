"""`llmso-lab bench kv-heads`: the result's structure and its exact parts, on the tiny random model (seconds)."""
import json

import pytest

from llmso_lab import hardware as hw
from llmso_lab.bench.kv_heads import FULL, QUICK, run


@pytest.fixture(scope="module")
def res():
    return run(quick=True, model="tiny-llama", ppl_tokens=200, ppl_window=100, b1_prompt=12, b1_tokens=5, batch=3,
               context=40, batch_tokens=4)


def test_bench_kv_heads_structure(res):
    assert res["name"] == "kv_heads" and {"device", "date", "command", "settings", "tables"} <= set(res)
    rows = {r["attention"]: r for r in res["table"]}
    assert list(rows) == ["MHA", "GQA", "MQA"] and [r["kv_heads"] for r in res["table"]] == [4, 2, 1]
    # tiny-llama: 2 layers, head_dim 16, fp32 in the engine
    assert [r["kv_bytes_per_token"] for r in res["table"]] == [hw.kv_cache_bytes(2, h, 16, 4, 1) for h in (4, 2, 1)]
    assert [r["kv_bytes_per_token_bf16"] for r in res["table"]] == [hw.kv_cache_bytes(2, h, 16, 2, 1) for h in (4, 2, 1)]
    assert [r["seqs_of_40_in_1GiB"] for r in res["table"]] == [2**30 // hw.kv_cache_bytes(2, h, 16, 4, 48) for h in (4, 2, 1)]
    assert rows["MHA"]["perplexity"] == pytest.approx(rows["GQA"]["perplexity"], rel=1e-5)   # exact copies
    assert rows["MQA"]["perplexity"] != pytest.approx(rows["GQA"]["perplexity"], rel=1e-3)  # pooled, not uptrained
    assert res["greedy_outputs_equal_to_as_trained"]["MHA"] is True
    assert all(r["decode_tok_s_batch1"] > 0 and r["decode_tok_s_batch3x40"] > 0 for r in res["table"])
    assert all(r["timed_steps"] == "4 + 3" for r in res["table"])   # 5 and 4 tokens: the first comes with the prefill
    r = res["ratios"]
    assert r["kv_bytes_mha_over_gqa"] == 2 == r["kv_bytes_gqa_over_mqa"] and r["perplexity_gqa_over_mha"] == 1
    assert r["bytes_read_big_batch_mha_over_gqa"] > 1 and r["bytes_read_big_batch_gqa_over_mqa"] > 1
    assert all(v > 0 for v in r.values())
    sizing = next(iter(res["tables"].values()))
    assert [row["model"] for row in sizing][-1] == "SmolLM2-135M"
    json.dumps(res)


def test_settings():
    assert set(FULL) == set(QUICK) and QUICK["batch"] * QUICK["context"] < FULL["batch"] * FULL["context"]
    with pytest.raises(ValueError, match="unknown settings"):
        run(quick=True, model="tiny-llama", batch_size=3)


def test_cli_takes_the_dashed_name(monkeypatch, capsys, tmp_path):
    import llmso_lab.bench.kv_heads as bench
    from llmso_lab.cli import main

    monkeypatch.setattr(bench, "run", lambda quick=False: {"table": [{"attention": "GQA"}], "ratios": {"x": 2.0},
                                                           "tables": {"sizing": [{"model": "m"}]}, "quick": quick})
    assert main(["bench", "kv-heads", "--quick", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "GQA" in out and "sizing:" in out and "x" in out
    assert json.loads((tmp_path / "r.json").read_text())["quick"] is True
    assert main(["bench", "kv-head"]) == 2
    assert "kv-heads" in capsys.readouterr().err   # the list of benchmarks uses the dashed names
