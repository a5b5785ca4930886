"""Batch grading: a folder of submissions into a CSV gradebook, N at a time, broken ones costing only their row,
a per-exercise summary, and a re-run that grades only what changed."""
import csv
import shutil
import subprocess
import sys

from llmso_lab.grading import batch
from llmso_lab.grading.batch import collect, grade_batch, summary
from llmso_lab.grading.registry import exercises
from lab_variants import ROOT, VARIANTS, notebook_with


def make_class(folder):
    folder.mkdir()
    shutil.copy(ROOT / "solutions" / "02_scheduling.ipynb", folder / "alice.ipynb")
    shutil.copy(ROOT / "labs" / "02_scheduling.ipynb", folder / "bob.ipynb")
    notebook_with("02", {"lab02/plan_token_budget": VARIANTS["lab02/plan_token_budget"]["wrong"][0]}, folder / "carol.ipynb")
    notebook_with("02", {"lab02/sjf_order": "def sjf_order(*a, **k):\n    while True:\n        pass\n"},
                  folder / "dave.ipynb")
    (folder / "eve.ipynb").write_text("{not a notebook")
    (folder / ".ipynb_checkpoints").mkdir()
    (folder / ".ipynb_checkpoints" / "alice-checkpoint.ipynb").write_text("{}")


def test_a_folder_becomes_a_gradebook_and_a_rerun_grades_only_changes(tmp_path, monkeypatch):
    make_class(tmp_path / "class")
    assert [p.name for p in collect([str(tmp_path / "class")])] == ["alice.ipynb", "bob.ipynb", "carol.ipynb",
                                                                   "dave.ipynb", "eve.ipynb"]
    book = tmp_path / "grades.csv"
    rows = grade_batch([str(tmp_path / "class")], "02", workers=2, csv_path=book, json_dir=tmp_path / "json",
                       timeout_s=8, progress=False)
    by = {r.file.rsplit("/", 1)[1]: r for r in rows}
    assert by["alice.ipynb"].total == 100 and by["alice.ipynb"].status == "graded"
    assert by["bob.ipynb"].total == 0 and by["bob.ipynb"].status == "graded"
    pts = {e.name: e.points for e in exercises("02")}
    carol = by["carol.ipynb"]
    assert carol.scores["plan_token_budget"] < pts["plan_token_budget"] and carol.total == 100 - pts["plan_token_budget"] + carol.scores["plan_token_budget"]
    assert by["dave.ipynb"].status == "timed out" and by["dave.ipynb"].total == 100 - pts["sjf_order"]
    assert by["eve.ipynb"].status == "unreadable" and by["eve.ipynb"].total == 0
    with open(book) as f:
        table = list(csv.DictReader(f))
    assert [r["file"].rsplit("/", 1)[1] for r in table] == sorted(by)
    assert {"file", "sha256", "status", "total", "plan_token_budget", "sjf_order"} <= set(table[0])
    assert sorted(p.name for p in (tmp_path / "json").iterdir()) == ["alice.json", "bob.json", "carol.json", "dave.json"]
    text = summary(rows, "02")
    assert "5 submissions: 3 graded, 1 timed out, 1 unreadable" in text
    assert "not implemented" in text and "timed out" in text   # the most common failures are named

    graded = []
    real = batch._grade_one
    monkeypatch.setattr(batch, "_grade_one", lambda p, *a: graded.append(p.name) or real(p, *a))
    shutil.copy(ROOT / "solutions" / "02_scheduling.ipynb", tmp_path / "class" / "bob.ipynb")   # bob resubmits
    rows = grade_batch([str(tmp_path / "class")], "02", workers=2, csv_path=book, timeout_s=8, progress=False)
    assert graded == ["bob.ipynb"]   # unchanged files (the unreadable one too) are not graded again
    assert {r.file.rsplit("/", 1)[1]: r.total for r in rows}["bob.ipynb"] == 100
    graded.clear()
    grade_batch([str(tmp_path / "class" / "alice.ipynb")], "02", csv_path=book, force=True, progress=False)
    assert graded == ["alice.ipynb"]


def test_the_cli_grades_a_glob_into_a_gradebook(tmp_path):
    for name in ("x", "y"):
        shutil.copy(ROOT / "solutions" / "02_scheduling.ipynb", tmp_path / f"{name}.ipynb")
    proc = subprocess.run([sys.executable, "-m", "llmso_lab.cli", "grade", str(tmp_path / "*.ipynb"), "--lab", "02",
                           "--csv", str(tmp_path / "g.csv"), "--workers", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 submissions: 2 graded" in proc.stdout and "100.0/100" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "llmso_lab.cli", "grade", str(tmp_path / "*.ipynb"), "--csv",
                           str(tmp_path / "g.csv")], capture_output=True, text=True)
    assert proc.returncode == 2 and "--lab NN" in proc.stderr
