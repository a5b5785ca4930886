"""Run NVIDIA kvpress beside the project's KV eviction, from the main venv (Lab 10, `bench kv-compress`).

kvpress 0.5.5 pins transformers < 5.3 and this project uses 5.x, so kvpress lives in its own venv
(`make peers-kvpress` builds `.venv-kvpress`: torch, kvpress 0.5.5, the transformers it resolves, no llmso_lab).
`run_kvpress` writes a JSON job (model folder, needle cases as text, presses, compression ratios), runs
`llmso_lab/bench/kvpress_peer.py` in that venv as a subprocess, and returns the peer's JSON output with the
needle answers re-scored by the project's own rule (`llmso_lab.kv.needle.needle_correct`).

kvpress speaks in `compression_ratio`, the fraction of KV pairs *removed*: ratios 0.5 / 0.75 / 0.9 are KV budgets
of 50 / 25 / 10 % of the context. Without `.venv-kvpress`, `run_kvpress` prints how to make it and returns None.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PRESSES", "MODES", "default_python", "make_job", "write_job", "parse_result", "run_kvpress",
           "accuracy_table"]

ROOT = Path(__file__).resolve().parents[2]
PEER_SCRIPT = Path(__file__).resolve().with_name("kvpress_peer.py")
# kvpress 0.5.5 presses that match the project's methods (ExpectedAttention and Knorm have no project twin)
PRESSES = ("StreamingLLMPress", "SnapKVPress", "PyramidKVPress", "ExpectedAttentionPress", "KnormPress")
MODES = ("agnostic", "aware", "pipeline")


def default_python() -> Path:
    """The kvpress venv's interpreter: `$LLMSO_LAB_KVPRESS_PYTHON`, else `.venv-kvpress/bin/python` in the repo."""
    return Path(os.environ.get("LLMSO_LAB_KVPRESS_PYTHON", ROOT / ".venv-kvpress" / "bin" / "python"))


def _case_dict(case, i: int) -> dict:
    """A needle case as the peer reads it: `{"name", "context", "question", "answer"}` (from a `Needle` or a dict)."""
    if isinstance(case, dict):
        missing = {"context", "question", "answer"} - case.keys()
        if missing:
            raise ValueError(f"case {i} lacks {sorted(missing)}: give context, question and answer texts "
                             f"(or a llmso_lab.kv.needle.Needle)")
        return {"name": str(case.get("name", f"case{i}")), "context": case["context"], "question": case["question"],
                "answer": str(case["answer"])}
    for attr in ("context", "question", "answer", "depth"):
        if not hasattr(case, attr):
            raise ValueError(f"case {i} is a {type(case).__name__}: pass a Needle (make_needle) or a dict with "
                             f"context, question and answer")
    return {"name": f"depth={case.depth:g}", "context": case.context, "question": case.question,
            "answer": case.answer}


def _case_dicts(cases: Sequence) -> list[dict]:
    """`_case_dict` of every case; needles at the same depth (e.g. two lengths) are told apart as "depth=0.5#1"."""
    out, seen = [], {}
    for i, c in enumerate(cases):
        d = _case_dict(c, i)
        if not isinstance(c, dict):
            k = seen[d["name"]] = seen.get(d["name"], -1) + 1
            if k:
                d["name"] += f"#{k}"
        out.append(d)
    return out


def make_job(cases: Sequence, presses: Sequence[str], ratios: Sequence[float], *, model_dir: str | Path,
             modes: Sequence[str] = ("agnostic",), perplexity: Sequence[dict] = (), max_new_tokens: int = 8,
             threads: int = 1) -> dict:
    """The job dictionary the peer reads (see `kvpress_peer`); validates everything it can without kvpress."""
    if not cases and not perplexity:
        raise ValueError("nothing to run: give at least one needle case or one perplexity case")
    for r in ratios:
        if not 0.0 <= float(r) < 1.0:
            raise ValueError(f"kvpress compression_ratio is the fraction of KV pairs removed and must be in [0, 1), "
                             f"got {r} (budget 10 % = ratio 0.9)")
    for p in presses:
        name = p if isinstance(p, str) else p.get("name") if isinstance(p, dict) else None
        if not name or not name[0].isupper():
            raise ValueError(f"presses are kvpress class names such as {PRESSES[:2]}, got {p!r}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes must be among {MODES}, got {bad}")
    for i, c in enumerate(perplexity):
        if not isinstance(c, dict) or not {"context", "continuation"} <= c.keys():
            raise ValueError(f"perplexity case {i} must be a dict with context and continuation texts")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    names = _case_dicts(cases)
    if len({c["name"] for c in names}) != len(names):
        raise ValueError(f"case names must be unique, got {[c['name'] for c in names]}")
    return {"model_dir": str(model_dir), "cases": names, "presses": list(presses),
            "ratios": [float(r) for r in ratios], "modes": list(modes), "max_new_tokens": int(max_new_tokens),
            "threads": int(threads),
            "perplexity": [{"name": str(c.get("name", f"ppl{i}")), "context": c["context"],
                            "continuation": c["continuation"]} for i, c in enumerate(perplexity)]}


def write_job(path: str | Path, job: dict) -> Path:
    """Write the job as JSON (UTF-8) and return its path."""
    path = Path(path)
    path.write_text(json.dumps(job, indent=1, ensure_ascii=False), encoding="utf-8")
    return path


def parse_result(text: str, cases: Sequence = ()) -> dict:
    """The peer's JSON output, checked; needle rows whose case is a `Needle` are re-scored with `needle_correct`
    (the peer's own `correct`, same rule, stays as `peer_correct`)."""
    from llmso_lab.kv.needle import needle_correct

    result = json.loads(text)
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list) or "versions" not in result:
        raise ValueError("not a kvpress peer result: expected a JSON object with 'versions' and 'rows'")
    needles = {d["name"]: c for d, c in zip(_case_dicts(cases), cases) if not isinstance(c, dict)}
    for row in result["rows"]:
        if "error" in row or row.get("case") not in needles:
            continue
        row["peer_correct"] = row.get("correct")
        row["correct"] = needle_correct(row["answer_text"], needles[row["case"]])
    return result


def run_kvpress(cases: Sequence, presses: Sequence[str] = PRESSES, ratios: Sequence[float] = (0.5, 0.75, 0.9),
                timeout_s: float = 600, *, modes: Sequence[str] = ("agnostic",), perplexity: Sequence[dict] = (),
                max_new_tokens: int = 8, threads: int = 1, model_dir: str | Path | None = None,
                python: str | Path | None = None, script: str | Path = PEER_SCRIPT) -> dict | None:
    """Run kvpress on `cases` (needles from `make_needle`, or dicts of texts) for every press x ratio (+ a no-press
    baseline) in each mode, in `.venv-kvpress`. Returns the peer's result dict (`versions`, `rows`, `perplexity`,
    `seconds`), or None, with the reason printed, when the venv does not exist.

    `model_dir` defaults to the cached SmolLM2 (fetched first if missing: the peer never downloads). Raises
    RuntimeError when the peer fails or runs past `timeout_s`.
    """
    python = Path(python) if python is not None else default_python()
    if not python.exists():
        print(f"kvpress peer skipped: no kvpress venv at {python}; run `make peers-kvpress` to build .venv-kvpress "
              f"(kvpress 0.5.5 pins transformers < 5.3, so it cannot share the main venv)")
        return None
    if model_dir is None:
        from llmso_lab.models.registry import fetch_model, is_cached, model_dir as cached_dir
        if not is_cached("smollm2-135m"):
            fetch_model("smollm2-135m")
        model_dir = cached_dir("smollm2-135m")
    job = make_job(cases, presses, ratios, model_dir=model_dir, modes=modes, perplexity=perplexity,
                   max_new_tokens=max_new_tokens, threads=threads)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the peer must not see llmso_lab
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory(prefix="kvpress-job-") as tmp:
        job_path, out_path = write_job(Path(tmp) / "job.json", job), Path(tmp) / "out.json"
        try:
            proc = subprocess.run([str(python), str(script), str(job_path), str(out_path)], capture_output=True,
                                  text=True, timeout=timeout_s, env=env, cwd=tmp)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"kvpress peer ran past timeout_s={timeout_s}: give fewer cases/presses/ratios or "
                               f"a larger timeout") from exc
        if proc.returncode or not out_path.exists():
            raise RuntimeError(f"kvpress peer failed (exit {proc.returncode}): {proc.stderr.strip()[-1500:]}")
        return parse_result(out_path.read_text(encoding="utf-8"), cases)


def accuracy_table(result: dict) -> list[dict]:
    """Needle accuracy per (mode, press, compression_ratio): `{"mode", "press", "compression_ratio",
    "budget_pct", "correct", "total", "errors"}`, in the order the rows first appear."""
    table: dict[tuple, dict] = {}
    for row in result["rows"]:
        key = (row["mode"], row["press"], row["compression_ratio"])
        t = table.setdefault(key, {"mode": key[0], "press": key[1], "compression_ratio": key[2],
                                   "budget_pct": round(100 * (1 - key[2])), "correct": 0, "total": 0, "errors": 0})
        if "error" in row:
            t["errors"] += 1
        else:
            t["total"] += 1
            t["correct"] += bool(row["correct"])
    return list(table.values())


if __name__ == "__main__":   # python -m llmso_lab.bench.kvpress_runner: the Lab 10 measurement, as JSON on stdout
    from llmso_lab.kv.needle import make_needle
    from llmso_lab.models import load_model

    _, tok = load_model("smollm2-135m")
    needles = [make_needle(tok, 512, d) for d in (0.1, 0.5, 0.9)]
    res = run_kvpress(needles, modes=sys.argv[1:] or ("agnostic",), max_new_tokens=6)
    if res is not None:
        res["accuracy"] = accuracy_table(res)
        print(json.dumps(res, indent=1))
