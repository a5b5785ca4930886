"""`make gpu-bench` (scripts/gpu_bench.py) checked for shape on CPU: no GPU has been lent to this project's CI.

The dry run drives every correctness check and the benchmarks' GPU code paths on tiny shapes under the Triton
interpreter; a kernel that disagrees with its reference must be reported (and fail the run), and a host without
CUDA must be told what to do rather than write an empty result.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_bench.py"
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                reason="the CPU dry run needs TRITON_INTERPRET=1 and no CUDA (make test sets it)")


def _load():
    spec = importlib.util.spec_from_file_location("gpu_bench_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_covers_every_kernel_and_writes_the_summary(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu-bench-cpu-dry-run.json").read_text())
    kernels = {r["kernel"] for r in summary["correctness"]}
    assert kernels == {"flash_attention", "flash_decoding", "paged_decode_attention", "mla_paged_decode_attention",
                       "w4a16_matmul", "verify_batch_triton"}
    assert summary["correctness_ok"] and all(r["ok"] for r in summary["correctness"])
    assert [p["status"] for p in summary["parts"]] == ["ok"] * len(summary["parts"])
    assert any("varlen" in r["case"] for r in summary["correctness"])       # the engine's packed prefill
    assert any("int8" in r["case"] for r in summary["correctness"])         # Lab 10's INT8 cache
    assert summary["versions"]["torch"] == torch.__version__ and "date" in summary
    assert "every kernel matches its reference" in proc.stdout


def test_a_wrong_kernel_is_reported_and_fails_the_run(tmp_path, monkeypatch):
    import llmso_lab.attention as attention
    mod = _load()
    real = attention.flash_attention

    def off_by_a_bit(q, k, v, causal=False, **kw):      # plausible bug: scale by 1/d instead of 1/sqrt(d)
        return real(q, k, v, causal, scale=1.0 / q.shape[-1], **kw)

    monkeypatch.setattr(attention, "flash_attention", off_by_a_bit)
    monkeypatch.setattr(mod, "CHECKS", [("flash", mod._check_flash)])
    assert mod.main(["--dry-run", "--out", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "gpu-bench-cpu-dry-run.json").read_text())
    assert not summary["correctness_ok"] and not any(r["ok"] for r in summary["correctness"])


def test_a_crashing_part_is_recorded_and_the_rest_still_runs(tmp_path, monkeypatch):
    mod = _load()

    def broken(dev, dtype):
        raise RuntimeError("PassManager::run failed")        # what a Triton compile error looks like

    monkeypatch.setattr(mod, "CHECKS", [("broken", broken), ("mla", mod._check_mla)])
    assert mod.main(["--dry-run", "--out", str(tmp_path)]) == 1
    parts = json.loads((tmp_path / "gpu-bench-cpu-dry-run.json").read_text())["parts"]
    assert parts[0]["status"] == "RuntimeError: PassManager::run failed" and "Traceback" in parts[0]["traceback"]
    assert [p["status"] for p in parts[1:]] == ["ok"] * (len(parts) - 1)


def test_without_cuda_it_says_how_to_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr and not list(tmp_path.iterdir())
