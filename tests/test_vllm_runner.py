"""The vLLM driver (`llmso_lab.bench.vllm_runner`) and `bench vllm` without the vLLM venv: job checks, the
missing-venv path, the stdin/stdout protocol and result parsing through a fake peer script that mimics
`vllm_peer.py`, the rounds' alternation and the greedy agreement."""
from __future__ import annotations

import ast
import json
import math
import sys
import textwrap
from pathlib import Path

import pytest

from llmso_lab.bench import vllm_runner as vr

# Mimics the peer: reads the job, answers one "ready" line (with the job's workloads run), then one line per
# command read from stdin. Output token k of a request is (last prompt id + 3k) % 97; vLLM metrics say
# TTFT = 0.01 (i + 1) and TPOT 2 ms for request i; a primed workload reports the prime as cached (whole blocks).
# FAKE_VLLM_LOG: append what it does (one line each); FAKE_VLLM_MODE: crash | error | short | slow | nometrics | noisy.
FAKE_PEER = textwrap.dedent('''
    import json, os, sys, time
    job = json.load(open(sys.argv[1]))
    mode = os.environ.get("FAKE_VLLM_MODE", "")
    log = os.environ.get("FAKE_VLLM_LOG")
    def note(text):
        if log:
            with open(log, "a") as f:
                f.write(text + "\\n")
    if mode == "crash":
        print("vllm exploded while loading", file=sys.stderr)
        sys.exit(3)
    if mode == "noisy":
        print("INFO some log line on stderr", file=sys.stderr)
    note("load " + job["engine"]["dtype"])
    bs = job["engine"]["block_size"]
    def run(w):
        rows, t = [], 0.0
        cached = (len(w["prime"][0]) // bs) * bs if w.get("prime") else 0
        for i, (p, n) in enumerate(zip(w["prompt_token_ids"], w["max_tokens"])):
            if mode == "short" and i == 0:
                n -= 1
            toks = [(p[-1] + 3 * k) % 97 for k in range(n)]
            ttft, tpot = 0.01 * (i + 1), 0.002
            times = [ttft + 0.003 * k for k in range(n)]
            rows.append({"request": i, "prompt_len": len(p), "output_token_ids": toks,
                         "num_cached_tokens": min(cached, len(p) - 1),
                         "vllm": None if mode == "nometrics" else {"ttft_s": ttft, "tpot_s": tpot},
                         "stream": {"ttft_s": times[0], "e2e_s": times[-1] + 0.001, "token_times_s": times}})
        return {"name": w["name"], "wall_s": max(r["stream"]["e2e_s"] for r in rows),
                "output_tokens": sum(len(r["output_token_ids"]) for r in rows), "requests": rows}
    out = os.fdopen(os.dup(1), "w")
    def reply(obj):
        out.write(json.dumps(obj) + "\\n")
        out.flush()
    reply({"ready": True, "load_s": 1.5, "warmup_s": 0.25, "versions": {"vllm": "0.32.0", "torch": "x"},
           "settings": dict(job["engine"]), "timing_source": {"ttft_s": "fake"}, "job_seen": job,
           "workloads": [run(w) for w in job["workloads"]]})
    seen = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        seen += 1
        if mode == "slow":
            time.sleep(30)
        if mode == "error":
            reply({"round": cmd["round"], "error": "RuntimeError: engine core died"})
            continue
        note(f"vllm {job['engine']['dtype']} round {cmd['round']}")
        reply({"round": cmd["round"], "commands_seen": seen, "workloads": [run(w) for w in cmd["workloads"]]})
''')


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def fake(tmp_path) -> Path:
    script = tmp_path / "fake_vllm_peer.py"
    script.write_text(FAKE_PEER)
    return script


def _workloads():
    return [vr.make_workload("cont", [[5, 6, 7], [8, 9, 10, 11]], [4, 2]),
            vr.make_workload("pre", [[1] * 40 + [2], [1] * 40 + [3]], 3, prime=[[1] * 40])]


def test_job_file_round_trip(tmp_path, model_dir):
    job = vr.make_job(_workloads(), model_dir=model_dir, threads=2, dtype="float32", max_num_seqs=4, max_model_len=64)
    back = json.loads(vr.write_job(tmp_path / "job.json", job).read_text(encoding="utf-8"))
    assert back == job
    assert back["engine"] == {**vr.ENGINE_DEFAULTS, "dtype": "float32", "max_num_seqs": 4, "max_model_len": 64}
    assert set(back["engine"]) == {"dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                                   "enable_prefix_caching", "enable_chunked_prefill", "kv_cache_memory_bytes",
                                   "enforce_eager", "seed"}   # vLLM's names
    assert back["workloads"][0] == {"name": "cont", "prompt_token_ids": [[5, 6, 7], [8, 9, 10, 11]], "max_tokens": [4, 2],
                                    "temperature": 0.0, "ignore_eos": True, "prime": [], "reset_prefix_cache": True}
    assert back["workloads"][1]["max_tokens"] == [3, 3] and back["workloads"][1]["prime"] == [[1] * 40]
    # the default warm-up: the first workload's first max_num_seqs prompts, 2 tokens each
    assert back["warmup"]["prompt_token_ids"] == [[5, 6, 7], [8, 9, 10, 11]] and back["warmup"]["max_tokens"] == [2, 2]
    assert vr.make_job(_workloads(), model_dir=model_dir, threads=1, warmup=None)["warmup"] is None
    assert vr.make_job(_workloads(), model_dir=model_dir)["threads"] >= 1   # default: this process's torch threads


def _bad(**change):
    def apply(job):
        for k, v in change.items():
            if k.startswith("w_"):
                job["workloads"][0][k[2:]] = v
            elif k in job["engine"] or k in vr.ENGINE_DEFAULTS:
                job["engine"][k] = v
            else:
                job[k] = v
        return job
    return apply


@pytest.mark.parametrize("change, match", [
    (_bad(w_temperature=0.7), "greedy only"),
    (_bad(w_ignore_eos=False), "ignore_eos must be true"),
    (_bad(w_prompt_token_ids=["hello there", [1, 2]]), "not text: tokenize it first"),
    (_bad(w_prompt_token_ids=[[1, -2], [3]]), "token ids"),
    (_bad(w_prompt_token_ids=[[], [3]]), "non-empty"),
    (_bad(w_max_tokens=[0, 2]), "max_tokens must be an int >= 1"),
    (_bad(w_max_tokens=[2]), "one max_tokens per request"),
    (_bad(w_prompt_token_ids=[], w_max_tokens=[]), "has no requests"),
    (_bad(w_max_tokens=[62, 2]), "max_model_len"),
    (_bad(dtype="int8"), "dtype must be one of"),
    (_bad(block_size=24), "multiples of 16"),
    (_bad(max_num_seqs=0), "max_num_seqs must be a positive int"),
    (_bad(enable_chunked_prefill=False, max_num_batched_tokens=32), "without chunked prefill"),
    (_bad(threads=0), "threads must be"),
    (_bad(v1_multiprocessing="yes"), "v1_multiprocessing must be"),
    (_bad(model_dir="/nonexistent/model"), "no config.json"),
])
def test_validate_job_rejects_bad_input(model_dir, change, match):
    job = vr.make_job(_workloads(), model_dir=model_dir, threads=1, max_model_len=64)
    with pytest.raises(ValueError, match=match):
        vr.validate_job(change(json.loads(json.dumps(job))))


def test_make_job_rejects_unknown_settings_and_duplicate_names(model_dir):
    with pytest.raises(ValueError, match="unknown engine settings.*gpu_memory"):
        vr.make_job(_workloads(), model_dir=model_dir, threads=1, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="unique"):
        vr.make_job(_workloads()[:1] * 2, model_dir=model_dir, threads=1)
    with pytest.raises(ValueError, match="make_job"):
        vr.validate_job({"workloads": []})


def test_missing_venv_returns_none_with_reason(tmp_path, model_dir, capsys, monkeypatch):
    job = vr.make_job(_workloads(), model_dir=model_dir, threads=1)
    assert vr.run_vllm(job, python=tmp_path / "nope" / "bin" / "python") is None
    out = capsys.readouterr().out
    assert "make peers-vllm" in out and str(tmp_path / "nope") in out
    monkeypatch.setenv("LLMSO_LAB_VLLM_PYTHON", str(tmp_path / "elsewhere" / "python"))
    assert vr.default_python() == tmp_path / "elsewhere" / "python"
    assert vr.start_peer(job) is None and "elsewhere" in capsys.readouterr().out
    with pytest.raises(ValueError, match="greedy"):   # a bad job is an error even without the venv
        bad = json.loads(json.dumps(job))
        bad["workloads"][0]["temperature"] = 1.0
        vr.run_vllm(bad)


def test_run_vllm_with_fake_peer_parses(model_dir, fake):
    job = vr.make_job(_workloads(), model_dir=model_dir, threads=2, max_model_len=64)
    res = vr.run_vllm(job, timeout_s=60, python=sys.executable, script=fake)
    assert res["job_seen"] == job                 # the peer got the token ids and vLLM's settings as sent
    assert res["load_s"] == 1.5 and res["warmup_s"] == 0.25 and res["versions"]["vllm"] == "0.32.0"
    cont, pre = res["workloads"]
    assert cont["name"] == "cont" and cont["output_tokens"] == 6
    r0, r1 = cont["requests"]
    assert r0["output_token_ids"] == [7, 10, 13, 16] and r1["output_token_ids"] == [11, 14]
    assert (r0["ttft_s"], r1["ttft_s"], r0["tpot_s"]) == (0.01, 0.02, 0.002)   # vLLM's own metrics
    assert r0["e2e_s"] == pytest.approx(0.01 + 3 * 0.003 + 0.001)             # the peer's stream
    assert r0["itl_s"] == pytest.approx([0.003] * 3)
    assert cont["timing_source"]["ttft_s"].startswith("vLLM RequestOutput.metrics")
    assert "peer" in cont["timing_source"]["e2e_s"]
    assert [r["num_cached_tokens"] for r in pre["requests"]] == [32, 32]       # prime of 40 = one 32-token block
    s = vr.summarize(pre["requests"], pre["wall_s"])
    assert s["prefix_hit_rate"] == pytest.approx(64 / 82)


def test_stream_timings_when_vllm_keeps_no_metrics(model_dir, fake, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "nometrics")
    job = vr.make_job(_workloads()[:1], model_dir=model_dir, threads=1, max_model_len=64)
    cont = vr.run_vllm(job, python=sys.executable, script=fake)["workloads"][0]
    r0 = cont["requests"][0]
    assert r0["ttft_s"] == pytest.approx(0.01) and r0["tpot_s"] == pytest.approx(0.003)   # from the token times
    assert cont["timing_source"]["ttft_s"].startswith("measured in the peer")


def test_peer_stays_loaded_across_rounds(tmp_path, model_dir, fake, monkeypatch):
    log = tmp_path / "log.txt"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    job = vr.make_job([], model_dir=model_dir, threads=1, max_model_len=64, dtype="float32",
                      warmup=vr.make_workload("warmup", [[1, 2]], 2))
    with vr.VllmPeer(job, python=sys.executable, script=fake) as peer:
        ready = peer.start()
        assert ready["workloads"] == [] and ready["start_s"] > 0
        for r in (1, 2):
            out = peer.run(_workloads(), round=r)
            assert [w["name"] for w in out] == ["cont", "pre"]
        with pytest.raises(ValueError, match="max_model_len"):   # checked here before it is sent
            peer.run([vr.make_workload("long", [[1] * 60], 10)])
        assert isinstance(peer.cpu_seconds(), float)
    assert log.read_text().splitlines() == ["load float32", "vllm float32 round 1", "vllm float32 round 2"]
    assert peer.proc.poll() is not None            # closed with the context


@pytest.mark.parametrize("mode, exc, match", [
    ("crash", RuntimeError, r"exit 3\).*vllm exploded while loading"),
    ("error", RuntimeError, "engine core died"),
    ("short", ValueError, "vLLM made 3 tokens, 4 were asked"),
])
def test_peer_failures_raise(model_dir, fake, monkeypatch, mode, exc, match):
    monkeypatch.setenv("FAKE_VLLM_MODE", mode)
    job = vr.make_job([], model_dir=model_dir, threads=1, max_model_len=64, warmup=None)
    with pytest.raises(exc, match=match):
        with vr.VllmPeer(job, python=sys.executable, script=fake) as peer:
            peer.start()
            peer.run(_workloads(), round=1)


def test_peer_timeout_kills_it(model_dir, fake, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "slow")
    job = vr.make_job([], model_dir=model_dir, threads=1, max_model_len=64, warmup=None)
    with vr.VllmPeer(job, python=sys.executable, script=fake, timeout_s=1) as peer:
        peer.start()
        with pytest.raises(RuntimeError, match="timeout"):
            peer.run(_workloads(), round=1)
        assert peer.proc.poll() is not None


def test_parse_rejects_other_json():
    with pytest.raises(ValueError, match="expected 2 workload results"):
        vr.parse_workloads([], _workloads())
    with pytest.raises(ValueError, match="not a vLLM peer result for workload 'cont'"):
        vr.parse_workloads([{"name": "other", "requests": []}, {}], _workloads())
    good = {"name": "cont", "wall_s": 1.0, "requests": [
        {"output_token_ids": [1, 2, 3, 4], "vllm": {"ttft_s": "soon", "tpot_s": 0.1}, "stream": {"e2e_s": 1.0}},
        {"output_token_ids": [1, 2], "vllm": None, "stream": {"ttft_s": 0.1, "e2e_s": 0.2, "token_times_s": [0.1, 0.2]}}]}
    with pytest.raises(ValueError, match="ttft_s is 'soon'"):
        vr.parse_workloads([good], _workloads()[:1])
    good["requests"][0]["vllm"]["ttft_s"] = 0.5
    out = vr.parse_workloads([good], _workloads()[:1])[0]
    assert out["timing_source"]["ttft_s"] == "mixed" and out["requests"][1]["tpot_s"] == pytest.approx(0.1)


def test_summarize_matches_the_project_percentiles():
    from llmso_lab.workloads import percentiles

    reqs = [{"output_token_ids": [0] * n, "ttft_s": t, "tpot_s": d, "e2e_s": e}
            for n, t, d, e in [(4, 0.1, 0.01, 0.2), (1, 0.3, 0.0, 0.3), (8, 0.2, 0.03, 0.5), (2, 0.7, 0.02, 0.9)]]
    s = vr.summarize(reqs, 2.0)
    assert s["output_tokens"] == 15 and s["output_tok_s"] == 7.5 and "prefix_hit_rate" not in s
    ttft = percentiles([r["ttft_s"] for r in reqs], (50, 99))
    tpot = percentiles([0.01, 0.03, 0.02], (50, 99))    # one-token answers have no TPOT
    assert s["ttft_p50_s"] == pytest.approx(ttft["p50"]) and s["ttft_p99_s"] == pytest.approx(ttft["p99"])
    assert s["tpot_p50_ms"] == pytest.approx(1e3 * tpot["p50"]) and s["tpot_p99_ms"] == pytest.approx(1e3 * tpot["p99"])
    assert vr.decode_tok_s(reqs[0]) == pytest.approx(100.0) and math.isnan(vr.decode_tok_s(reqs[1]))


def test_schedule_alternates_systems_within_each_dtype():
    from llmso_lab.bench.vllm import schedule

    assert schedule(("bfloat16", "float32"), 2) == [
        ("bfloat16", 1, "engine"), ("bfloat16", 1, "vllm"), ("bfloat16", 2, "engine"), ("bfloat16", 2, "vllm"),
        ("float32", 1, "engine"), ("float32", 1, "vllm"), ("float32", 2, "engine"), ("float32", 2, "vllm")]
    assert schedule(("bfloat16",), 2, with_vllm=False) == [("bfloat16", 1, "engine"), ("bfloat16", 2, "engine")]


TINY = dict(model="tiny-llama", workload=dict(num_requests=3, prompt_len=(4, 10), output_len=(2, 5), max_num_seqs=2,
                                              batch1_tokens=4),
            prefix=dict(num_requests=2, prefix_tokens=32, max_tokens=3), batch1_repeats=2, rounds=2, measure_seconds=0.05)


def test_bench_alternates_in_time_and_measures_agreement(tmp_path, fake, monkeypatch):
    """A fake engine whose tokens follow the fake peer's rule, except request 0 of the continuous workload from its
    token 1 on: agreement must be exactly (tokens before that divergence) / all. Both sides log their turns to one
    file, so its order is their order in time."""
    from llmso_lab.bench import vllm as bench

    log = tmp_path / "log.txt"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))

    def fake_engine(net, tokenizer, w, kw, desc=None):
        if w["name"] == "continuous":
            with open(log, "a") as f:
                f.write(f"engine {kw['dtype']}\n")
        reqs = []
        for i, (p, n) in enumerate(zip(w["prompt_token_ids"], w["max_tokens"])):
            toks = [(p[-1] + 3 * k) % 97 for k in range(n)]
            if w["name"] == "continuous" and i == 0:
                toks[1:] = [t + 1 for t in toks[1:]]
            reqs.append({"output_token_ids": toks, "prompt_len": len(p), "num_cached_tokens": 0, "ttft_s": 0.04,
                         "tpot_s": 0.004, "e2e_s": 0.04 + 0.004 * (n - 1)})
        return {"name": w["name"], "wall_s": 0.1, "requests": reqs}

    monkeypatch.setattr(bench, "_engine_workload", fake_engine)
    res = bench.run(quick=True, python=sys.executable, script=fake, native=False, **TINY)
    order = log.read_text().splitlines()   # the engine logs its timed continuous runs (not its warm-ups)
    assert order == ["load bfloat16", "engine bfloat16", "vllm bfloat16 round 1", "engine bfloat16",
                     "vllm bfloat16 round 2", "load float32", "engine float32", "vllm float32 round 1",
                     "engine float32", "vllm float32 round 2"]
    assert [(x["dtype"], x["round"], x["system"]) for x in res["timeline"]] == bench.schedule(("bfloat16", "float32"), 2)
    assert all(a["end_s"] <= b["start_s"] for a, b in zip(res["timeline"], res["timeline"][1:]))
    # agreement: request 0 of the continuous workload diverges at token 1
    outs = res["workload"]["continuous"]
    from llmso_lab.bench.batching import workload
    reqs, _ = workload(outs["num_requests"], tuple(outs["prompt_len"]), tuple(outs["output_len"]), 256)
    expected = (1 + sum(r.output_len for r in reqs[1:])) / sum(r.output_len for r in reqs)
    assert res["ratios"]["tokens_equal_continuous_bf16"] == pytest.approx(expected, abs=1e-3)
    assert res["ratios"]["tokens_equal_prefix_bf16"] == res["ratios"]["tokens_equal_batch1_fp32"] == 1.0
    agree = res["tables"]["greedy agreement, engine vs vLLM (round 1, tokens before the first divergence)"]
    cont = next(a for a in agree if a["dtype"] == "bfloat16" and a["workload"] == "continuous")
    assert cont["identical"] == pytest.approx(2 / 3, abs=1e-3) and cont["first_divergence_median"] == 1
    # fake engine: 0.04 s TTFT, 4 ms TPOT; fake vLLM: 0.01 (i + 1) s TTFT, 2 ms TPOT
    assert res["ratios"]["engine_vs_vllm_batch1_bf16"] == pytest.approx(0.5)
    assert res["ratios"]["engine_vs_vllm_prefix_ttft_p50"] == pytest.approx(0.015 / 0.04, abs=1e-3)


def test_bench_json_shape_on_the_tiny_model(fake, capsys):
    """The real engine on the tiny model against the fake peer: every figure and ratio the bench promises."""
    from llmso_lab.bench.vllm import run

    res = run(quick=True, python=sys.executable, script=fake, native=False, **TINY)
    json.dumps(res)
    assert res["name"] == "vllm" and res["dtypes"] == ["bfloat16", "float32"]
    assert [(r["dtype"], r["system"]) for r in res["table"]] == [
        ("bfloat16", "engine"), ("bfloat16", "vLLM 0.32.0"), ("float32", "engine"), ("float32", "vLLM 0.32.0")]
    for row in res["table"]:
        assert row["output_tok_s"] > 0 and 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert 0 < row["tpot_p50_ms"] <= row["tpot_p99_ms"] and row["batch1_tok_s"] > 0
        assert row["prefix_ttft_p50_s"] > 0 and row["same_tokens_every_round"] is True
    eng = res["table"][0]
    assert eng["prefix_hit_rate"] > 0                 # the engine's cache holds the primed system prompt's block
    keys = set()
    for k in ("bf16", "fp32"):
        keys |= {f"engine_vs_vllm_continuous_{k}", f"engine_vs_vllm_batch1_{k}"}
        keys |= {f"tokens_equal_{w}_{k}" for w in ("continuous", "batch1", "prefix")}
    keys |= {"engine_vs_vllm_prefix_ttft_p50", "engine_vs_vllm_prefix_ttft_p50_fp32"}
    keys |= {k + "_worst_round" for k in keys if k.startswith("engine_vs")}
    assert set(res["ratios"]) == keys
    assert all(v > 0 for k, v in res["ratios"].items() if k.startswith("engine_vs"))
    assert all(0 <= v <= 1 for k, v in res["ratios"].items() if k.startswith("tokens_equal"))
    rounds = res["tables"]["round by round (engine and vLLM alternate; ratios > 1: the engine is better)"]
    assert [(x["dtype"], x["round"]) for x in rounds] == [("bfloat16", 1), ("bfloat16", 2), ("float32", 1), ("float32", 2)]
    for k in ("bf16", "fp32"):
        mine = [x for x in rounds if x["dtype"] == ("bfloat16" if k == "bf16" else "float32")]
        assert res["ratios"][f"engine_vs_vllm_continuous_{k}_worst_round"] == pytest.approx(
            min(x["continuous_ratio"] for x in mine), abs=2e-3)
        assert all(x["peer_cpu_s_during_engine"] is not None for x in mine)
    assert res["vllm"]["bfloat16"]["load_s"] == 1.5 and res["vllm"]["float32"]["warmup_s"] == 0.25
    assert res["settings"]["bfloat16"]["block_size"] == 32 and res["settings"]["float32"]["dtype"] == "float32"
    assert res["settings"]["bfloat16"]["max_num_seqs"] == 2
    assert {"device", "date", "command", "timeline", "workload", "load_avg", "ceilings"} <= set(res)
    # both systems of a dtype are a share of the same measured bound; bf16 moves half the bytes of fp32
    for row in res["table"]:
        c = res["ceilings"][row["dtype"]]
        # (the ceilings are recorded to 3 places and the row to 1: a value near x.x5 may round either way)
        assert row["roofline_bound_tok_s"] == pytest.approx(c["continuous"], abs=0.051)
        assert row["batch1_ceiling_tok_s"] == pytest.approx(c["batch1"], abs=0.051)
        assert row["roofline_share"] == pytest.approx(row["output_tok_s"] / c["continuous"], rel=2e-2, abs=2e-3)
        assert row["batch1_share"] == pytest.approx(row["batch1_tok_s"] / c["batch1"], rel=2e-2, abs=2e-3)
    assert res["ceilings"]["bfloat16"]["batch1"] == pytest.approx(2 * res["ceilings"]["float32"]["batch1"], rel=0.05)


def test_bench_without_the_venv_measures_the_engine_alone(tmp_path, capsys):
    from llmso_lab.bench.vllm import run

    res = run(quick=True, dtype="float32", python=tmp_path / "no" / "python", native=False, **TINY)
    assert "make peers-vllm" in capsys.readouterr().out
    assert res["ratios"] == {} and "make peers-vllm" in res["vllm"]["skipped"]
    assert [(r["dtype"], r["system"]) for r in res["table"]] == [("float32", "engine")]
    assert [(x["system"], x["round"]) for x in res["timeline"]] == [("engine", 1), ("engine", 2)]
    assert res["table"][0]["output_tok_s"] > 0 and res["command"].endswith("--dtype float32")
    json.dumps(res)


def test_bench_times_the_native_path_as_a_third_system(fake):
    """Where the native path builds, the engine with it is a third system in the same alternation, with its own
    ratios against vLLM."""
    from llmso_lab.bench import vllm as bench
    from llmso_lab.engine import native

    res = bench.run(quick=True, dtype="float32", python=sys.executable, script=fake, native=True, **TINY)
    assert res["native"] == native.load()[1]
    if native.load()[0] is None:   # not buildable here: no third system, and the JSON says why
        assert bench.NATIVE not in {r["system"] for r in res["table"]}
        return
    assert [r["system"] for r in res["table"]] == ["engine", bench.NATIVE, "vLLM 0.32.0"]
    assert [(x["round"], x["system"]) for x in res["timeline"]] == [
        (1, "engine"), (1, bench.NATIVE), (1, "vllm"), (2, "engine"), (2, bench.NATIVE), (2, "vllm")]
    assert res["timeline"] and [tuple(x) for x in bench.schedule(("float32",), 2, native=True)] == [
        ("float32", r, s) for r in (1, 2) for s in ("engine", bench.NATIVE, "vllm")]
    for w in ("continuous_fp32", "batch1_fp32", "prefix_ttft_p50_fp32"):
        assert res["ratios"][f"engine_native_vs_vllm_{w}"] > 0
        assert res["ratios"][f"engine_native_vs_vllm_{w}_worst_round"] > 0
    rounds = res["tables"]["round by round (engine and vLLM alternate; ratios > 1: the engine is better)"]
    assert all(x["native_batch1_tok_s"] > 0 and x["native_continuous_ratio"] > 0 for x in rounds)


def test_cli_knows_the_bench_and_its_dtype():
    import inspect

    from llmso_lab.bench import vllm as bench
    assert "dtype" in inspect.signature(bench.run).parameters   # `llmso-lab bench vllm --dtype bfloat16`


def test_peer_script_imports_no_llmso_lab():
    """The peer runs in a venv without llmso_lab: only the stdlib, torch and vllm may be imported."""
    tree = ast.parse(vr.PEER_SCRIPT.read_text())
    roots = {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    roots |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert roots <= set(sys.stdlib_module_names) | {"torch", "vllm", "__future__"}, roots
    assert 'if __name__ == "__main__":' in vr.PEER_SCRIPT.read_text()   # vLLM spawns its engine core


def test_peer_helpers_load_in_the_main_venv(monkeypatch):
    """The peer imports only the standard library at module level; its metric conversion and thread binding."""
    import importlib.util
    from types import SimpleNamespace

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "TOKENIZERS_PARALLELISM"):
        monkeypatch.setenv(var, "1")   # the peer sets them at import; restored afterwards
    spec = importlib.util.spec_from_file_location("vllm_peer_under_test", vr.PEER_SCRIPT)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    stats = SimpleNamespace(first_token_latency=0.5, first_token_ts=10.0, last_token_ts=10.3, queued_ts=9.0,
                            scheduled_ts=9.1, num_generation_tokens=4, num_preemptions=0)
    m = peer._vllm_metrics(stats, 4)
    assert m["ttft_s"] == 0.5 and m["tpot_s"] == pytest.approx(0.1) and m["prefill_s"] == pytest.approx(0.9)
    assert peer._vllm_metrics(None, 4) is None
    assert peer._threads_bind(1).count(",") == 0 and peer._threads_bind(1).isdigit()
    assert set(peer.ENGINE_KEYS) == set(vr.ENGINE_DEFAULTS)
    # run as a script its folder would head sys.path, where the bench's vllm.py would shadow the vllm package
    assert (vr.PEER_SCRIPT.parent / "vllm.py").exists() and peer._HERE == str(vr.PEER_SCRIPT.parent)
    assert str(vr.PEER_SCRIPT.parent) not in sys.path
