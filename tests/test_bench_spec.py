"""`llmso-lab bench spec` in miniature: the table, the batch and per-prompt tables, the HF peer and the ratios are
all produced, and speculative greedy output equals plain decoding on SmolLM2 (n-gram and EAGLE)."""
import pytest

from llmso_lab.bench import spec


@pytest.mark.slow
def test_bench_spec_runs_and_outputs_equal_plain_decoding():
    r = spec.run(quick=True, methods=("ngram", "eagle"), ks=(2,), prompts=1, new_tokens=8)
    assert {row["method"] for row in r["table"]} == {"ngram", "eagle"}
    assert all(row["identical_outputs"] == "1/1" for row in r["table"])
    assert {row["method"] for row in r["tables"]["batch"]} == {"plain", "ngram", "eagle"}
    assert len(r["tables"]["per_prompt"]) == 2 and len(r["tables"]["hf_peer"]) == 3
    assert all(row["copy_identical_to_engine"] == "1/1" for row in r["tables"]["hf_peer"])
    for key in ("ngram_vs_plain_copy_batch1", "best_learned_vs_plain_chat_batch1", "ngram_vs_hf_prompt_lookup_copy_batch1"):
        assert r["ratios"][key] > 0


def test_copy_rate_counts_what_prompt_lookup_drafts_right():
    prompt = [5, 6, 7, 8, 9, 1]
    assert spec.copy_rate(prompt, [5, 6, 7, 8]) == pytest.approx(0.5)   # after "1 5": nothing; "5 6" -> 7 right, 8 right
    assert spec.copy_rate(prompt, [2, 3, 4]) == 0.0
