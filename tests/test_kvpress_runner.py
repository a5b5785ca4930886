"""The kvpress driver (`llmso_lab.bench.kvpress_runner`) without the kvpress venv: job files, the missing-venv
message, and result parsing through a fake peer script that mimics `kvpress_peer.py`'s output format."""
from __future__ import annotations

import ast
import json
import sys
import textwrap
from pathlib import Path

import pytest

from llmso_lab.bench import kvpress_runner as kr
from llmso_lab.kv.needle import Needle, needle_correct

NEEDLES = [Needle("Filler. The secret code is 4821. More filler.", "\n\nQuestion: What is the secret code?\nAnswer:"
                  " The secret code is", "4821", 0.5),
           Needle("The secret code is 1234. Filler text.", "\n\nQuestion: What is the secret code?\nAnswer:"
                  " The secret code is", "1234", 0.0)]

# Mimics the peer: reads the job, writes one row per (mode, press or "none", ratio, case). The "answer" is the
# case's code for ratio < 0.8, a wrong code above, and "12345" for the case at depth 0 when the press is
# KnormPress (wrong: needle_correct wants the first number to be the code itself); "BrokenPress" fails.
FAKE_PEER = textwrap.dedent('''
    import json, sys
    job = json.load(open(sys.argv[1]))
    rows = []
    for mode in job["modes"]:
        for press, ratio in [("none", 0.0)] + [(p, r) for p in job["presses"] for r in job["ratios"]]:
            for case in job["cases"]:
                row = {"press": press, "compression_ratio": ratio, "mode": mode, "case": case["name"]}
                if press == "BrokenPress":
                    row["error"] = "ValueError: no such press"
                else:
                    ans = case["answer"] if ratio < 0.8 else "0000"
                    if press == "KnormPress" and case["name"] == "depth=0":
                        ans = case["answer"] + "5"
                    row.update(answer_text=" " + ans + ".", answer_ids=[1, 2], context_tokens=len(case["context"]),
                               question_tokens=3, kept_min=1, kept_max=1, kept_mean=1.0, prefill_s=0.1,
                               decode_s=0.1, total_s=0.2, correct=True)
                rows.append(row)
    json.dump({"versions": {"kvpress": "0.5.5", "transformers": "5.2.0", "torch": "x"}, "rows": rows,
               "perplexity": [], "seconds": 0.0, "job_seen": job}, open(sys.argv[2], "w"))
''')


def _fake(tmp_path: Path, body: str = FAKE_PEER) -> Path:
    script = tmp_path / "fake_peer.py"
    script.write_text(body)
    return script


def test_job_file_round_trip(tmp_path):
    ppl = [{"context": "A b c.", "continuation": " D e f."}]
    job = kr.make_job(NEEDLES + [{"context": "x", "question": "y", "answer": 7, "name": "mine"}],
                      ["SnapKVPress", {"name": "PyramidKVPress", "kwargs": {"window_size": 32}}], [0.5, 0.9],
                      model_dir=tmp_path / "model", modes=("agnostic", "aware"), perplexity=ppl, max_new_tokens=6)
    path = kr.write_job(tmp_path / "job.json", job)
    back = json.loads(path.read_text(encoding="utf-8"))
    assert back == job
    assert [c["name"] for c in back["cases"]] == ["depth=0.5", "depth=0", "mine"]
    assert back["cases"][0] == {"name": "depth=0.5", "context": NEEDLES[0].context, "question": NEEDLES[0].question,
                                "answer": "4821"}
    assert back["cases"][2]["answer"] == "7"   # answers travel as text
    # two needles at one depth (two lengths) get distinct names
    twice = kr.make_job(NEEDLES[:1] * 2, ["SnapKVPress"], [0.5], model_dir=tmp_path)
    assert [c["name"] for c in twice["cases"]] == ["depth=0.5", "depth=0.5#1"]
    assert back["model_dir"] == str(tmp_path / "model") and back["ratios"] == [0.5, 0.9]
    assert back["presses"][1] == {"name": "PyramidKVPress", "kwargs": {"window_size": 32}}
    assert back["perplexity"] == [{"name": "ppl0", "context": "A b c.", "continuation": " D e f."}]
    assert back["max_new_tokens"] == 6 and back["modes"] == ["agnostic", "aware"]


@pytest.mark.parametrize("kwargs, match", [
    ({"ratios": [0.5, 1.0]}, "fraction of KV pairs removed"),
    ({"ratios": [-0.1]}, r"\[0, 1\)"),
    ({"presses": ["snapkv"]}, "kvpress class names"),
    ({"modes": ["question-aware"]}, "modes must be among"),
    ({"cases": [{"context": "x", "answer": "1"}]}, "lacks"),
    ({"cases": ["just text"]}, "pass a Needle"),
    ({"cases": [{"name": "a", "context": "x", "question": "q", "answer": "1"}] * 2}, "unique"),
    ({"cases": [], "perplexity": []}, "nothing to run"),
    ({"perplexity": [{"context": "x"}]}, "continuation"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_make_job_rejects_bad_input(tmp_path, kwargs, match):
    args = {"cases": NEEDLES, "presses": ["SnapKVPress"], "ratios": [0.5]} | kwargs
    with pytest.raises(ValueError, match=match):
        kr.make_job(args.pop("cases"), args.pop("presses"), args.pop("ratios"), model_dir=tmp_path, **args)


def test_missing_venv_returns_none_with_reason(tmp_path, capsys, monkeypatch):
    assert kr.run_kvpress(NEEDLES, python=tmp_path / "nope" / "bin" / "python", model_dir=tmp_path) is None
    out = capsys.readouterr().out
    assert "make peers-kvpress" in out and str(tmp_path / "nope") in out
    monkeypatch.setenv("LLMSO_LAB_KVPRESS_PYTHON", str(tmp_path / "elsewhere" / "python"))
    assert kr.default_python() == tmp_path / "elsewhere" / "python"
    assert kr.run_kvpress(NEEDLES, model_dir=tmp_path) is None
    assert "elsewhere" in capsys.readouterr().out


def test_run_with_fake_peer_parses_and_rescores(tmp_path):
    res = kr.run_kvpress(NEEDLES, ["KnormPress", "BrokenPress"], [0.5, 0.9], timeout_s=60, modes=("agnostic", "aware"),
                         python=sys.executable, script=_fake(tmp_path), model_dir=tmp_path / "m")
    assert res["versions"]["kvpress"] == "0.5.5"
    assert res["job_seen"]["model_dir"] == str(tmp_path / "m")
    rows = res["rows"]
    assert len(rows) == 2 * (1 + 2 * 2) * 2    # modes x (baseline + presses x ratios) x cases
    for row in rows:
        if "error" in row:
            assert row["press"] == "BrokenPress"
            continue
        needle = NEEDLES[0] if row["case"] == "depth=0.5" else NEEDLES[1]
        assert row["correct"] == needle_correct(row["answer_text"], needle)
        assert row["peer_correct"] is True         # the fake peer claimed every row correct
    table = {(t["mode"], t["press"], t["compression_ratio"]): t for t in kr.accuracy_table(res)}
    assert len(table) == 2 * 5
    assert table[("agnostic", "none", 0.0)] | {} == {"mode": "agnostic", "press": "none", "compression_ratio": 0.0,
                                                     "budget_pct": 100, "correct": 2, "total": 2, "errors": 0}
    assert (table[("aware", "KnormPress", 0.5)]["correct"], table[("aware", "KnormPress", 0.5)]["total"]) == (1, 2)
    assert table[("aware", "KnormPress", 0.9)]["correct"] == 0 and table[("aware", "KnormPress", 0.9)]["budget_pct"] == 10
    assert table[("agnostic", "BrokenPress", 0.5)] | {} == {"mode": "agnostic", "press": "BrokenPress",
                                                            "compression_ratio": 0.5, "budget_pct": 50, "correct": 0,
                                                            "total": 0, "errors": 2}


def test_peer_failure_and_timeout_raise(tmp_path):
    crash = _fake(tmp_path, "import sys\nprint('kvpress exploded', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(RuntimeError, match=r"exit 3\).*kvpress exploded"):
        kr.run_kvpress(NEEDLES, python=sys.executable, script=crash, model_dir=tmp_path)
    slow = _fake(tmp_path, "import time\ntime.sleep(30)\n")
    with pytest.raises(RuntimeError, match="timeout_s"):
        kr.run_kvpress(NEEDLES, timeout_s=1, python=sys.executable, script=slow, model_dir=tmp_path)


def test_parse_result_rejects_other_json():
    with pytest.raises(ValueError, match="not a kvpress peer result"):
        kr.parse_result(json.dumps({"rows": []}))
    res = kr.parse_result(json.dumps({"versions": {}, "rows": [{"case": "dict case", "answer_text": "1", "correct": 1}]}),
                          [{"name": "dict case", "context": "c", "question": "q", "answer": "2"}])
    assert res["rows"][0]["correct"] == 1 and "peer_correct" not in res["rows"][0]   # dict cases: the peer's word


def test_peer_script_imports_no_llmso_lab():
    """The peer runs in a venv without llmso_lab: only stdlib, torch, transformers and kvpress may be imported."""
    tree = ast.parse(kr.PEER_SCRIPT.read_text())
    roots = {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    roots |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    allowed = set(sys.stdlib_module_names) | {"torch", "transformers", "kvpress", "__future__"}
    assert roots <= allowed, roots - allowed


def test_peer_answer_rule_matches_needle_correct(monkeypatch):
    """The peer repeats `needle_correct` (it cannot import it); both must score the same texts alike. The peer
    imports only the standard library at module level, so the main venv can load it."""
    import importlib.util

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):   # the peer sets them at import; restored afterwards
        monkeypatch.setenv(var, "1")
    spec = importlib.util.spec_from_file_location("kvpress_peer_under_test", kr.PEER_SCRIPT)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    needle = NEEDLES[0]
    for text in [" 4821.", " 48210", "4821 or 1234", "1234 or 4821", " no code", "", " 4821\n\nThe", "code 04821"]:
        assert peer.answer_correct(text, needle.answer) == needle_correct(text, needle), text
    assert peer.MODES == kr.MODES
