"""The serving part of `make demo` on a tiny random model (seconds, no download)."""
from llmso_lab.demo import COLUMNS, serving_demo
from llmso_lab.models import load_model


def test_serving_demo_table_and_plots(tmp_path, capsys):
    model, tok = load_model("tiny-llama")
    rows = serving_demo(model, tok, tmp_path, num_requests=4, prefix_len=64, own_len=(8, 32), output_len=(8, 24),
                        slots=2)
    table = capsys.readouterr().out
    assert [r["system"] for r in rows][:4] == ["HF generate static", "engine static", "engine continuous",
                                               "engine continuous + prefix cache"]
    assert len(rows) == 5 and "KV blocks" in rows[4]["system"]
    assert all(set(COLUMNS) <= set(r) for r in rows)
    assert all(header in table for header in COLUMNS.values()) and "prefix caching" in table
    assert len({r["output_tokens"] for r in rows}) == 1 and all(r["requests"] == 4 for r in rows)
    hf, static, cont, cached, small = rows
    assert small["preemptions"] > 0
    assert hf["preemptions"] == static["preemptions"] == cont["preemptions"] == cached["preemptions"] == 0
    assert cached["prefix_hit_rate"] > 0 and small["prefix_hit_rate"] > 0
    assert static["prefix_hit_rate"] == cont["prefix_hit_rate"] == 0 and hf["prefix_hit_rate"] == "-"
    assert all(r["tpot_p50_ms"] > 0 for r in rows)
    for name in ("latency_cdf.png", "engine_slot_grid_static.png", "engine_slot_grid_continuous.png"):
        assert (tmp_path / name).stat().st_size > 0
