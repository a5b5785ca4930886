"""Grade many submissions of one lab into a CSV gradebook (`llmso-lab grade SUBMISSIONS... --lab NN`).

Submissions are files, folders (every notebook below them) or glob patterns. `workers` of them are graded at
once, each exactly as `llmso-lab grade` grades one (its exercises one after another, each in its sandbox), so
at most `workers` student processes run at a time. A broken or hostile submission costs its own row only. The
gradebook has one row per submission (file, sha256, status, total, one column per exercise); running again
skips files whose hash is already graded for this lab unless `force`. At the end a per-exercise summary
(mean, share with full marks, most common failure) shows where the class struggled.
"""
from __future__ import annotations

import csv
import glob
import json
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from llmso_lab.grading.grader import ExerciseResult, grade_notebook
from llmso_lab.grading.registry import exercises
from llmso_lab.models.registry import sha256_file

__all__ = ["collect", "grade_batch", "summary", "Row"]

STATUSES = ("graded", "timed out", "unreadable", "error")


@dataclass(slots=True)
class Row:
    file: str
    sha256: str
    lab: str
    status: str
    total: float
    scores: dict[str, float]
    failures: dict[str, str] = field(default_factory=dict)   # exercise -> the first reason it lost points


def collect(inputs: list[str]) -> list[Path]:
    """Notebook paths from files, folders and glob patterns (sorted, each once)."""
    out: dict[Path, None] = {}
    for item in inputs:
        matches = [Path(item)] if Path(item).exists() else [Path(m) for m in sorted(glob.glob(item, recursive=True))]
        if not matches:
            raise ValueError(f"{item}: no such file, folder or matching pattern")
        for m in matches:
            if m.is_dir():
                for p in sorted(m.rglob("*.ipynb")):
                    if ".ipynb_checkpoints" not in p.parts:
                        out[p] = None
            else:
                out[m] = None
    return list(out)



def _grade_one(path: Path, lab: str, names: list[str], json_dir: Path | None, timeout_s: float | None) -> Row:
    digest = sha256_file(path)
    details: list[ExerciseResult] = []
    try:
        res = grade_notebook(path, lab=lab, workers=1, timeout_s=timeout_s, details=details)
    except ValueError as exc:   # not a readable notebook
        return Row(str(path), digest, lab, "unreadable", 0.0, dict.fromkeys(names, 0.0), {"": str(exc)[:200]})
    except Exception as exc:    # noqa: BLE001 - one submission never stops the batch
        return Row(str(path), digest, lab, "error", 0.0, dict.fromkeys(names, 0.0), {"": f"{type(exc).__name__}: {exc}"[:200]})
    if json_dir is not None:
        (json_dir / f"{path.stem}.json").write_text(json.dumps(res, indent=1))
    failures = {}
    for r in details:
        reasons = [v for i, v in enumerate(r.verdicts or [r.lines[-1]]) if v is not None]
        if reasons:
            failures[r.exercise.name] = str(reasons[0])[:120]
    timed_out = any("timed out" in ln for r in details for ln in r.lines)
    return Row(str(path), digest, lab, "timed out" if timed_out else "graded", res["score"],
               {r.exercise.name: r.score for r in details}, failures)


def _read_gradebook(path: Path, names: list[str]) -> dict[str, Row]:
    rows = {}
    if not path.exists():
        return rows
    with open(path, newline="") as f:
        for rec in csv.DictReader(f):
            try:
                rows[rec["file"]] = Row(rec["file"], rec["sha256"], rec["lab"], rec["status"], float(rec["total"]),
                                        {n: float(rec.get(n) or 0) for n in names},
                                        json.loads(rec.get("failures") or "{}"))
            except (KeyError, ValueError):
                continue   # a hand-edited or foreign row: it will be graded again
    return rows


def _write_gradebook(path: Path, rows: list[Row], names: list[str]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file", "sha256", "lab", "status", "total", *names, "failures"])
        for r in rows:
            w.writerow([r.file, r.sha256, r.lab, r.status, f"{r.total:g}", *[f"{r.scores.get(n, 0.0):g}" for n in names],
                        json.dumps(r.failures, ensure_ascii=False)])
    os.replace(tmp, path)


def grade_batch(inputs: list[str], lab: str, *, workers: int | None = None, csv_path: Path | None = None,
                json_dir: Path | None = None, force: bool = False, timeout_s: float | None = None,
                progress: bool = True) -> list[Row]:
    """Grade every submission in `inputs` as lab `lab`; returns the gradebook rows (also written to csv_path)."""
    exs = exercises(lab)
    lab, names = exs[0].lab, [e.name for e in exs]
    paths = collect(inputs)
    workers = max(1, workers or os.cpu_count() or 1)
    known = _read_gradebook(Path(csv_path), names) if csv_path and not force else {}
    if json_dir is not None:
        json_dir = Path(json_dir)
        json_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, Row] = dict(known)
    todo = []
    for p in paths:
        old = known.get(str(p))
        if old is not None and old.lab == lab and old.status != "error" and old.sha256 == sha256_file(p):
            continue   # graded before, unchanged
        todo.append(p)
    from tqdm.auto import tqdm

    with ThreadPoolExecutor(workers) as pool, tqdm(total=len(todo), desc=f"grading lab {lab}", unit="nb",
                                                    disable=not progress) as bar:
        futures = [pool.submit(_grade_one, p, lab, names, json_dir, timeout_s) for p in todo]
        for fut in as_completed(futures):
            row = fut.result()
            rows[row.file] = row
            bar.update(1)
            if csv_path:   # keep the gradebook current: an interrupted batch resumes where it stopped
                _write_gradebook(Path(csv_path), sorted(rows.values(), key=lambda r: r.file), names)
    out = sorted(rows.values(), key=lambda r: r.file)
    if csv_path:
        _write_gradebook(Path(csv_path), out, names)
    return out


def summary(rows: list[Row], lab: str) -> str:
    """Per exercise: mean score, share of submissions with full marks, and the most common failure."""
    exs = exercises(lab)
    graded = [r for r in rows if r.status in ("graded", "timed out")]
    counts = Counter(r.status for r in rows)
    lines = [f"{len(rows)} submissions: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s]),
             f"{'exercise':<28} {'mean':>7} {'full marks':>11}  most common failure", "-" * 100]
    for ex in exs:
        scores = [r.scores.get(ex.name, 0.0) for r in graded]
        mean = sum(scores) / len(scores) if scores else 0.0
        full = sum(s >= ex.points for s in scores) / len(scores) if scores else 0.0
        reasons = Counter(r.failures[ex.name] for r in graded if ex.name in r.failures)
        common = f"{reasons.most_common(1)[0][0][:70]} ({reasons.most_common(1)[0][1]}x)" if reasons else ""
        lines.append(f"{ex.name:<28} {mean:>5.1f}/{ex.points:<3g} {full:>9.0%}  {common}")
    totals = [r.total for r in graded]
    if totals:
        lines.append(f"{'total':<28} {sum(totals) / len(totals):>5.1f}/100")
    return "\n".join(lines)
